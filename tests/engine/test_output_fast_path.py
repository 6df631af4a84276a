"""The output processor's one-token path (no text kept, no mask): every stop rule ends a request
where the greedy sequence says it must, in a batch, with async scheduling on and off."""
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

PROMPT = [5, 9, 13, 2, 7]
MAX_MODEL_LEN = 40


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    return LLMEngine(str(path), stream_text=False, block_size=8, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                     max_num_batched_tokens=64)


def run(engine, requests: dict) -> dict:
    """request id -> its final RequestOutput."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def first_new(tokens: list[int], after: int) -> int:
    """An index k >= after whose token does not occur before it."""
    return next(k for k in range(after, len(tokens)) if tokens[k] not in tokens[:k])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_rules_end_requests_where_the_greedy_sequence_says(engine, async_scheduling):
    engine.async_scheduling = async_scheduling
    room = MAX_MODEL_LEN - len(PROMPT)
    greedy = run(engine, {"g": SamplingParams(max_tokens=room, ignore_eos=True)})["g"].outputs[0].token_ids
    assert len(greedy) == room
    k_stop, k_eos = first_new(greedy, 3), first_new(greedy, 6)
    eos = engine.eos_token_ids
    engine.eos_token_ids = (greedy[k_eos],)  # this run's EOS: a token the greedy sequence reaches
    try:
        out = run(engine, {
            "stop": SamplingParams(max_tokens=room, stop_token_ids=[greedy[k_stop]], ignore_eos=True),
            "eos": SamplingParams(max_tokens=room),
            "eos ignored": SamplingParams(max_tokens=room - 2, ignore_eos=True),
            "max": SamplingParams(max_tokens=4, ignore_eos=True),
            "room": SamplingParams(ignore_eos=True),  # max_tokens held to the room left
            "logprobs": SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True),
            "one": SamplingParams(max_tokens=1, ignore_eos=True),
            "greedy": SamplingParams(max_tokens=room, ignore_eos=True),
        })
    finally:
        engine.eos_token_ids = eos
    want = {"stop": (k_stop + 1, "stop", greedy[k_stop]), "eos": (k_eos + 1, "stop", greedy[k_eos]),
            "eos ignored": (room - 2, "length", None), "max": (4, "length", None), "room": (room, "length", None),
            "logprobs": (5, "length", None), "one": (1, "length", None), "greedy": (room, "length", None)}
    for rid, (n, reason, stop_reason) in want.items():
        c = out[rid].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (greedy[:n], reason, stop_reason), rid
    lps = out["logprobs"].outputs[0].logprobs
    assert len(lps) == 5 and all(t in lp and len(lp) >= 2 for t, lp in zip(greedy, lps))
    assert not engine.has_unfinished_requests() and engine.pool.num_free == engine.pool.num_blocks
