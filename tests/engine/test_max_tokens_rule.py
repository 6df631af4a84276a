"""One rule for max_tokens beyond the model's length, in the Python API and the server alike:
a number the caller gives must fit (prompt + max_tokens <= max_model_len), else the same
"maximum context length" error; left unset, it is held to the room the prompt leaves."""
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.sampling_params import DEFAULT_MAX_TOKENS, context_length_message


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    return LLM(str(path), max_model_len=64, max_num_seqs=2, warmup=False)


def test_unset_max_tokens_is_the_default_held_to_the_room_left(llm):
    params = SamplingParams(ignore_eos=True)
    assert params.max_tokens == DEFAULT_MAX_TOKENS and not params.max_tokens_given
    out = llm.generate([[5] * 10], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 64 - 10 and out.finish_reason == "length"


def test_a_given_max_tokens_beyond_the_model_length_is_an_error(llm):
    with pytest.raises(ValueError) as e:
        llm.generate([[5] * 10], SamplingParams(max_tokens=100000), use_tqdm=False)
    assert str(e.value) == context_length_message(64, 10, 100000)
    assert "maximum context length is 64 tokens" in str(e.value)
    assert llm.stats()["num_requests_running"] == 0 and not llm.engine.has_unfinished_requests()
    # exactly the room left is fine
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=54, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 54


def test_the_server_answers_the_same_words(llm):
    from pagedjax.entrypoints.openai.errors import APIError
    from pagedjax.entrypoints.openai.serving_common import ServingBase

    serving = ServingBase.__new__(ServingBase)
    serving.max_model_len = 64
    with pytest.raises(APIError) as e:
        serving.resolve_max_tokens(100000, None, 10, "max_tokens", "prompt")
    assert e.value.message == context_length_message(64, 10, 100000)


def test_beam_search_follows_the_same_rule(llm):
    from pagedjax import BeamSearchParams

    with pytest.raises(ValueError) as e:
        llm.beam_search([[5] * 10], beam_width=2, max_tokens=100000, use_tqdm=False)
    assert str(e.value) == context_length_message(64, 10, 100000)
    assert not llm.engine.has_unfinished_requests()
    params = BeamSearchParams(beam_width=2, ignore_eos=True)
    assert not params.max_tokens_given and params == BeamSearchParams(beam_width=2, ignore_eos=True)
    out = llm.beam_search([[5] * 60], params=params, use_tqdm=False)[0]
    assert {len(s.token_ids) for s in out.sequences} == {4}  # held to the room left


def test_defaults_are_held_not_promised(llm):
    """The model's generation-config defaults and the params a library builds for its callers
    (Tunix's rollout) are held to the room left, like the engine's own default."""
    params = llm.get_default_sampling_params()
    assert not params.max_tokens_given
    assert SamplingParams(max_tokens=64) == SamplingParams()  # the flag is not part of equality
    out = llm.generate([[5] * 60], SamplingParams(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4


def test_generate_flags_promise_max_tokens_only_when_given():
    """`pagedjax generate` without --max-tokens holds its default (128) to the room left; with
    the flag, the number must fit."""
    from pagedjax.entrypoints.cli import build_parser, _sampling_params

    parse = build_parser().parse_args
    unset = _sampling_params(parse(["generate", "hi"]))
    given = _sampling_params(parse(["generate", "hi", "--max-tokens", "128"]))
    assert unset.max_tokens == given.max_tokens == 128
    assert not unset.max_tokens_given and given.max_tokens_given
