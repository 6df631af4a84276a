"""bench_speculative.speculation_ceiling: the speed-up that measured step costs allow a batch."""
from __future__ import annotations

import pytest
from script_module import load_script

bench = load_script("bench_speculative")
STEP_MS = {8: 30.0, 16: 45.0, 32: 80.0, 48: 110.0}


def test_ceiling_picks_the_best_depth_at_the_given_acceptance():
    # depth 1: (1 + .75) * 30 / 45; depth 2 runs 24 tokens at the 32-token cost: 2.3125 * 30 / 80
    assert bench.speculation_ceiling(STEP_MS, 8, 0.75, 4) == pytest.approx((1.75 * 30 / 45, 1))
    # every draft accepted: depth 3 fills the 32-token step exactly, 4 * 30 / 80
    assert bench.speculation_ceiling(STEP_MS, 8, 1.0, 4) == pytest.approx((1.5, 3))


def test_ceiling_without_a_paying_depth_is_plain_decoding():
    assert bench.speculation_ceiling(STEP_MS, 8, 0.2, 4) == (1.0, 0)
    # depths past the largest measured size are not priced
    assert bench.speculation_ceiling({8: 30.0, 16: 45.0}, 8, 1.0, 4) == pytest.approx((2 * 30 / 45, 1))


def test_ceiling_needs_a_measured_plain_step():
    with pytest.raises(ValueError, match="no measured step"):
        bench.speculation_ceiling({4: 10.0}, 8, 0.5, 4)
