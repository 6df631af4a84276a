"""While the background warm-up runs, a large batch compiles the rungs it wants first (and
runs on them), a small request compiles nothing; outputs are the same either way."""
import threading

import numpy as np

from pagedjax import LLM, SamplingParams
from pagedjax.worker.compile_ahead import QueuedWork, plan, work_seconds

LADDER_8 = [8]


def test_a_large_batch_pays_for_its_rungs_and_a_small_request_does_not():
    # the default model on a 2-core CPU: a T = 8 step takes 22 ms, a compile 2 s
    batch = QueuedWork(prompt_tokens=16 * 128, rows=16, decode_tokens=16 * 128)
    assert plan(batch, LADDER_8, [16, 2048], 0.022, 8, 2.0) == [16, 2048]
    small = QueuedWork(prompt_tokens=30, rows=1, decode_tokens=16)
    assert plan(small, LADDER_8, [8, 48], 0.022, 8, 2.0) == []
    # decode only (the prompts are in): the decode rung pays, no prompt rung is wanted
    decode = QueuedWork(prompt_tokens=0, rows=16, decode_tokens=16 * 500)
    assert plan(decode, LADDER_8, [16], 0.022, 8, 2.0) == [16]
    assert plan(decode, LADDER_8, [16], 0.022, 8, 60.0) == []  # a compile dearer than the work


def test_work_seconds_counts_padding_to_a_large_rung():
    """A decode of 20 rows with only 8 and 2048 compiled runs padded to 2048 (its estimate
    shows it), so the 32 rung pays for itself at once."""
    decode = QueuedWork(prompt_tokens=0, rows=20, decode_tokens=20 * 64)
    padded = work_seconds(decode, [8, 2048], 0.022, 8)
    assert padded > 10 * work_seconds(decode, [8, 32, 2048], 0.022, 8)
    assert plan(decode, [8, 2048], [32], 0.022, 8, 2.0) == [32]


def _held_warmup(llm) -> threading.Event:
    """A background warm-up that primed T = 8 (timed) and then waits for the event: the
    warm-up stays in progress, deterministically, for the test."""
    runner, release = llm.engine.runner, threading.Event()
    runner._compile_load_slot()
    runner.prime_bucket(8, timed=True)
    runner.background_warmup.start([(lambda t: release.wait(), 0)])
    return release


def test_large_batch_runs_on_rungs_compiled_ahead_with_the_same_outputs(tiny_checkpoints):
    path, _ = tiny_checkpoints("qwen2")
    kw = dict(max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=64, max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 300, size=int(n)).tolist() for n in (50, 61, 40, 57, 33, 45)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = LLM(str(path), **kw)
    reference.wait_for_warmup()
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(path), warmup=False, **kw)
    release = _held_warmup(llm)
    runner = llm.engine.runner
    runner.compile_seconds = {8: 1e-4}  # compiles look free: the batch's rungs pay for themselves
    rungs = []
    llm.engine.step_observers.append(lambda rec: rungs.append(runner.step_rung(max(sum(o.q_lens) for o in rec.outs if o))))
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert not runner.warmup_done
        # 4 rows decode on the 8 rung; the prompts want the full 64 budget: compiled ahead, and
        # the held warm-up itself compiled nothing
        assert runner.compiled_shapes == [8, 64], "the batch's prompt rung was not compiled ahead"
        assert max(rungs) == 64, f"the prompts ran in steps of {sorted(set(rungs))}, not the full budget"
        assert got == want
        assert llm.stats()["kv_blocks_free"] == 64
    finally:
        release.set()
        llm.wait_for_warmup()


def test_a_small_request_compiles_nothing_ahead(tiny_checkpoints):
    path, _ = tiny_checkpoints("qwen2")
    llm = LLM(str(path), warmup=False, max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=64,
              max_num_batched_tokens=64)
    release = _held_warmup(llm)
    try:
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert llm.engine.runner.compiled_shapes == [8]
    finally:
        release.set()
        llm.wait_for_warmup()
