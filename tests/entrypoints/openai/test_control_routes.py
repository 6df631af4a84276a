"""The routes a training loop drives the server with: /reset_prefix_cache, /sleep (a request
while asleep is a 503), /is_sleeping, /wake_up."""
import httpx
import openai
import pytest

from .conftest import openai_client, running_server


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    from pagedjax.engine.llm_engine import LLMEngine

    path, _ = tiny_checkpoints("qwen3")
    engine = LLMEngine(str(path), max_model_len=128, max_num_seqs=2, block_size=8, num_blocks=32)
    with running_server(engine) as s:
        s.client = openai_client(s.url)
        yield s


def _complete(server):
    return server.client.completions.create(model="fake-model", prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13], max_tokens=6,
                                            temperature=0).choices[0].text


def test_sleep_refuses_requests_until_wake_up(server):
    before = _complete(server)
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False, "sleep_level": 0}
    r = httpx.post(server.url + "/sleep", params={"level": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True, "sleep_level": 2}
    with pytest.raises(openai.APIStatusError) as err:
        _complete(server)
    assert err.value.status_code == 503 and "asleep" in str(err.value)
    assert httpx.post(server.url + "/wake_up", timeout=60).status_code == 200
    assert _complete(server) == before
    assert httpx.post(server.url + "/sleep", params={"level": 3}).status_code == 400


def test_reset_prefix_cache(server):
    _complete(server)
    pool = server.async_engine.engine.pools[0]
    assert pool.num_cached > 0
    r = httpx.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert pool.num_cached == 0
