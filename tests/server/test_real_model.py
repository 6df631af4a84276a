"""The server over the real engine and the embedded default model, driven by the openai client."""
import httpx
import pytest

from .conftest import metric, openai_client, running_server


@pytest.fixture(scope="module")
def real_server(default_model_path):
    from pagedjax.engine import LLMEngine

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
