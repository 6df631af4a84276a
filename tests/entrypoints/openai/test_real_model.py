"""The server over the real engine and the embedded default model, driven by the openai client."""
import httpx
import pytest

from .conftest import metric, openai_client, running_server


@pytest.fixture(scope="module")
def real_server(default_model_path):
    from pagedjax.engine.llm_engine import LLMEngine

    engine = LLMEngine(None, max_model_len=256, max_num_seqs=4, num_blocks=64)
    with running_server(engine) as s:
        yield s


def test_chat_completion_and_stream_on_the_default_model(real_server):
    client = openai_client(real_server.url).with_options(timeout=300)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: streaming gives the same answer
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert metric(real_server.url, "pagedjax:kv_blocks_free") == 64  # every block returned
    assert httpx.get(real_server.url + "/health").status_code == 200


def test_beam_search_over_http_equals_llm_beam_search(real_server, default_model_path):
    from pagedjax import LLM, BeamSearchParams

    ids = real_server.engine.tokenizer.encode("The capital of France is")
    client = openai_client(real_server.url).with_options(timeout=300)
    r = client.completions.create(model="fake-model", prompt=ids, max_tokens=8, n=3,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.8})
    llm = LLM(default_model_path, max_model_len=256, max_num_seqs=4, num_blocks=64, warmup=False)
    want = llm.beam_search([ids], params=BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.8),
                           use_tqdm=False)[0]
    assert [(c.text, c.finish_reason) for c in r.choices] == [(s.text, s.finish_reason) for s in want.sequences]
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want.sequences)
    assert metric(real_server.url, "pagedjax:kv_blocks_free") == 64  # every beam's blocks returned


def test_scoring_request_on_the_default_model(real_server):
    """What evaluation harnesses send: echo + logprobs + max_tokens 0 (the prompt scored, nothing generated)."""
    client = openai_client(real_server.url).with_options(timeout=300)
    prompt = "The capital of France is Paris"
    n = len(real_server.engine.tokenizer.encode(prompt))
    r = client.completions.create(model="fake-model", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens) == (prompt, "length", 0, n)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] > -5  # " Paris" after "The capital of France is" is likely
    # the same numbers in vLLM's prompt_logprobs shape
    body = {"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 1}
    plp = httpx.post(real_server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["prompt_logprobs"]
    ids = real_server.engine.tokenizer.encode(prompt)
    assert plp[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert metric(real_server.url, "pagedjax:kv_blocks_free") == 64
