"""On-device sampler: filters, seeds, batch independence."""
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.sample.sampler import SamplingInputs
from pagedjax.sample.sampler import sample as _sample

sample = jax.jit(_sample)  # as the engine runs it (eager lax.cond would compile on every call)


def inputs(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=None):
    f = lambda v: jnp.full((n,), v, jnp.float32)
    return SamplingInputs(f(temperature), jnp.full((n,), top_k, jnp.int32), f(top_p), f(min_p),
                          jnp.asarray(seeds if seeds is not None else range(n), jnp.uint32),
                          jnp.asarray(steps if steps is not None else [0] * n, jnp.int32), jnp.ones((n,), bool))


def logits(n, v=50, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, v)) * 3, jnp.float32)


def test_greedy_is_argmax_and_logprobs_are_raw():
    x = logits(4)
    out = sample(x, inputs(4, temperature=0.0))
    np.testing.assert_array_equal(out.tokens, np.argmax(x, -1))
    lp = np.asarray(x) - np.log(np.exp(np.asarray(x, np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, lp[np.arange(4), out.tokens], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], np.argmax(x, -1))


def test_top_k_one_and_tiny_top_p_and_min_p_one_are_greedy():
    x = logits(8, seed=1)
    want = np.argmax(x, -1)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        np.testing.assert_array_equal(sample(x, inputs(8, temperature=1.5, **kw)).tokens, want)


def test_top_k_restricts_support():
    x = logits(1, seed=2)
    top3 = set(np.argsort(-np.asarray(x[0]))[:3].tolist())
    drawn = {int(sample(x, inputs(1, top_k=3, seeds=[s])).tokens[0]) for s in range(60)}
    assert drawn <= top3 and len(drawn) > 1


def test_top_p_restricts_support():
    x = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    drawn = {int(sample(x, inputs(1, top_p=0.7, seeds=[s])).tokens[0]) for s in range(80)}
    assert drawn == {0, 1}


def test_seeded_samples_do_not_depend_on_the_batch():
    x = logits(1, v=1000, seed=3)
    alone = [int(sample(x, inputs(1, seeds=[42], steps=[s])).tokens[0]) for s in range(5)]
    batch = jnp.concatenate([logits(3, v=1000, seed=4), x])
    together = [int(sample(batch, inputs(4, seeds=[1, 2, 3, 42], steps=[s] * 4)).tokens[3]) for s in range(5)]
    assert alone == together
    other_seed = [int(sample(x, inputs(1, seeds=[43], steps=[s])).tokens[0]) for s in range(5)]
    assert other_seed != alone


def test_top_k_holds_when_the_kept_mass_rounds_below_one():
    """Past the top k, the mass ranked above a token could round to just under top_p = 1.0,
    which once let every token through (found by the speculative-decoding chi-square test)."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(64, 384)) * 1.5, jnp.float32)
    top4 = np.argsort(-np.asarray(x), axis=-1)[:, :4]
    for seeds in range(4):
        out = sample(x, inputs(64, temperature=0.8, top_k=4, seeds=range(seeds * 64, seeds * 64 + 64)))
        assert all(t in row for t, row in zip(np.asarray(out.tokens), top4))


def _kept_reference(x: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The tokens a row may draw (numpy, float64, by the definitions): the top k, then the
    smallest set of highest-probability tokens whose mass reaches top_p, then those at least
    min_p times as likely as the most likely; ties with the last kept logit are kept too."""
    z = x / temperature
    order = np.argsort(-z, kind="stable")
    k = top_k if top_k > 0 else len(z)
    desc = z[order][:k]
    probs = np.exp(desc - desc.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = (before < top_p) & (probs >= min_p * probs[0])
    keep[0] = True
    return z >= desc[keep].min()


def test_filters_match_a_full_sort_inside_and_beyond_the_candidates():
    """The cut is found among the TOP_CANDIDATES largest logits, and from a full sort when a
    row keeps more (flat rows, top_k past the candidates); rows that do not filter, and a
    step where none does, keep every token."""
    from pagedjax.sample.sampler import TOP_CANDIDATES, _filtered_logits

    v = 4 * TOP_CANDIDATES
    rng = np.random.default_rng(5)
    sharp = rng.normal(size=(4, v)) * 4.0  # a few hundred tokens carry the mass
    flat = rng.normal(size=(4, v)) * 0.05  # thousands of tokens to reach top_p
    x = np.concatenate([sharp, flat]).astype(np.float32)
    cases = [  # temperature, top_k, top_p, min_p per row
        (1.0, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.2, 0, 1.0, 0.05), (1.0, TOP_CANDIDATES + 100, 0.95, 0.0),
        (1.0, 0, 0.99, 0.0), (1.0, 3 * TOP_CANDIDATES, 1.0, 0.0), (0.0, 5, 0.5, 0.0), (1.0, 0, 1.0, 0.0),
    ]
    t, k, p_, m = (np.array(c) for c in zip(*cases))
    p = SamplingInputs(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p_, jnp.float32),
                       jnp.asarray(m, jnp.float32), jnp.zeros(8, jnp.uint32), jnp.zeros(8, jnp.int32),
                       jnp.zeros(8, bool))
    got = np.isfinite(np.asarray(jax.jit(_filtered_logits)(jnp.asarray(x), p)))
    for i, (temp, top_k, top_p, min_p) in enumerate(cases):
        if temp == 0:  # greedy: drawn from the unfiltered logits
            continue
        if top_k == 0 and top_p >= 1 and min_p == 0:
            assert got[i].all(), f"row {i} does not filter"
            continue
        want = _kept_reference(x[i].astype(np.float64), temp, top_k, top_p, min_p)
        assert (got[i] == want).all(), f"row {i}: kept {got[i].sum()} tokens, want {want.sum()}"
    assert got[4].sum() > TOP_CANDIDATES and got[5].sum() == 3 * TOP_CANDIDATES  # past the candidates
    only_temperature = SamplingInputs(p.temperature, jnp.zeros(8, jnp.int32), jnp.ones(8, jnp.float32),
                                      jnp.zeros(8, jnp.float32), p.seed, p.step, p.want_logprobs)
    assert np.isfinite(np.asarray(jax.jit(_filtered_logits)(jnp.asarray(x), only_temperature))).all()


def test_argmax_is_the_first_maximum_of_each_row():
    """The blocked argmax (vocabularies of 1024, 256 and 128-logit blocks, and one without
    blocks) against numpy's, with ties within a block, across blocks, at block edges, first
    maxima past the first block, and a row of equal values."""
    from pagedjax.sample.sampler import argmax
    rng = np.random.default_rng(5)
    for v in (49152, 32000, 384, 50):
        x = rng.normal(size=(12, v)).astype(np.float32)
        top = x.max() + 1
        x[1, [7, v - 1]] = top  # the first of two, far apart
        x[2, [v // 2, v // 2 + 1]] = top  # neighbours
        x[3, [v - 1]] = top  # the very last
        x[4, :] = 0.0  # all equal: index 0
        c = next((c for c in (1024, 512, 256, 128) if v % c == 0 and v > c), 16)  # the block size used
        x[5, [c - 1, c]] = top  # both sides of a block edge
        x[6, [2 * c + 1, c + 5]] = top  # the first maximum in a block past the first, a tie in a later one
        x[7, [c + 9, c + 2]] = top  # a tie within one block past the first
        x[8, [2 * c - 1]] = top  # the last of a block past the first
        np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), np.argmax(x, -1), err_msg=str(v))


def _sampler_cases():
    """(name, logits [6, V], SamplingInputs, bitmask, penalty state): greedy, sampled with
    filters and log-probabilities, penalties, a token mask, drafts: every cond of sample_step."""
    from pagedjax.sample.penalties import PenaltyState

    n, v = 6, 40
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(n, v)) * 3, jnp.float32)
    ones = jnp.full((n, 2), -1, jnp.int32)  # [S, W]: every token allowed
    state = PenaltyState(jnp.asarray(rng.integers(0, 3, (8, v)), jnp.int32), jnp.asarray(rng.random((8, v)) < 0.2),
                         jnp.zeros((8, v), jnp.float32))
    base = dict(temperature=jnp.asarray([0, 0.8, 1.2, 0, 1.0, 0.5], jnp.float32),
                top_k=jnp.asarray([0, 5, 0, 0, 0, 600], jnp.int32), top_p=jnp.asarray([1, 1, 0.9, 1, 1, 0.99], jnp.float32),
                min_p=jnp.asarray([0, 0, 0, 0, 0.1, 0], jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32),
                step=jnp.arange(n, dtype=jnp.int32), want_logprobs=jnp.asarray([1, 0, 1, 0, 0, 1], bool),
                penalty_slot=jnp.full(n, -1, jnp.int32), repetition=jnp.full(n, 1.3, jnp.float32),
                frequency=jnp.full(n, 0.5, jnp.float32), presence=jnp.full(n, 0.2, jnp.float32),
                produces=jnp.ones(n, bool), constrained=jnp.zeros(n, bool), draft_next=jnp.full(n, -1, jnp.int32))
    masked = ones.at[1].set(jnp.asarray([0b1011, 0], jnp.int32))
    cases = {"plain": ({}, ones), "greedy only": ({"temperature": jnp.zeros(n, jnp.float32)}, ones),
             "penalties": ({"penalty_slot": jnp.asarray([0, -1, 3, 7, -1, 2], jnp.int32)}, ones),
             "mask": ({"constrained": jnp.asarray([0, 1, 0, 0, 0, 0], bool)}, masked),
             "drafts": ({"draft_next": jnp.asarray([4, -1, 7, 9, 1, -1], jnp.int32)}, ones)}
    return [(name, x, SamplingInputs(**{**base, **changes}), mask, state) for name, (changes, mask) in cases.items()]


def test_sampler_selects_on_gpus_as_it_branches_elsewhere():
    """On GPUs each cond of the sampler is both branches and a select (pagedjax.sample.select_cond:
    no conditional, which would make the host wait for the device); the samples, log-
    probabilities, draft verdicts and penalty counts are those of the branching form."""
    from pagedjax.sample import select_cond
    from pagedjax.sample.sampler import sample_step

    for name, x, p, mask, state in _sampler_cases():
        runs = {}
        for select in (False, True):
            jax.clear_caches()
            with select_cond.forced(select):
                fn = jax.jit(lambda *a: sample_step(*a))
                hlo = fn.lower(x, p, mask, state).as_text()
                assert ("stablehlo.case" in hlo or "stablehlo.if" in hlo) != select, name
                runs[select] = jax.tree.map(np.asarray, fn(x, p, mask, state))
        jax.clear_caches()
        (state_b, out_b), (state_s, out_s) = runs[False], runs[True]
        np.testing.assert_array_equal(state_s.counts, state_b.counts, err_msg=name)
        for field in ("tokens", "top_ids", "accepted", "resampled"):
            np.testing.assert_array_equal(getattr(out_s, field), getattr(out_b, field), err_msg=f"{name}: {field}")
        for field in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(getattr(out_s, field), getattr(out_b, field), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name}: {field}")


def test_inverse_cdf_draws_follow_the_softmax():
    """20,000 draws over 6 tokens (one masked): frequencies within 4 standard errors of
    softmax(x), the masked token never."""
    import jax
    import jax.numpy as jnp

    from pagedjax.sample.sampler import inverse_cdf

    x = jnp.array([2.0, 1.0, 0.5, -1.0, -jnp.inf, 0.0], jnp.float32)
    n = 20_000
    u = jax.random.uniform(jax.random.key(3), (n,))
    tokens = np.asarray(inverse_cdf(jnp.broadcast_to(x, (n, x.shape[0])), u))
    want = np.asarray(jax.nn.softmax(x))
    got = np.bincount(tokens, minlength=x.shape[0]) / n
    assert got[4] == 0
    np.testing.assert_array_less(np.abs(got - want), 4 * np.sqrt(want * (1 - want) / n) + 1e-9)
    edge = np.asarray(inverse_cdf(x[None], jnp.array([0.0])))  # u = 0: the last token with mass, never one without
    assert edge[0] == 5


def test_inverse_cdf_keeps_the_tail_of_a_large_vocabulary():
    """One dominant token and 60k tail tokens of relative probability 5e-8 each (0.3% of the
    mass together), each below half an ulp of a running sum near 1: a sequential float32
    running sum would round them away; the draw keeps their mass."""
    import jax
    import jax.numpy as jnp

    from pagedjax.sample.sampler import inverse_cdf

    v, n, chunk = 60_000, 4_000, 500
    x = jnp.full((v,), -16.8, jnp.float32).at[7].set(0.0)
    tail = float(1 - jax.nn.softmax(x)[7])
    draw = jax.jit(lambda u: inverse_cdf(jnp.broadcast_to(x, (chunk, v)), u))
    u = jax.random.uniform(jax.random.key(1), (n,))
    tokens = np.concatenate([np.asarray(draw(u[i:i + chunk])) for i in range(0, n, chunk)])
    got = float(np.mean(tokens != 7))
    assert 0.002 < tail < 0.005 and got > 0 and abs(got - tail) < 5 * np.sqrt(tail / n)
    assert tokens.max() < v
