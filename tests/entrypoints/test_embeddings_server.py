"""POST /v1/embeddings over real uvicorn and the real engine, with the official `openai`
client (float and base64), against the offline LLM.embed; bad input is a 400 in OpenAI's
error shape."""
import base64
import shutil

import httpx
import numpy as np
import openai
import pytest

from tiny_models import make_tokenizer

from .openai.conftest import MODEL, openai_client, running_server

ENGINE = dict(dtype="float32", max_model_len=128, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 4, "x"]


@pytest.fixture(scope="module")
def path(tiny_checkpoints, tmp_path_factory):
    """The tiny qwen3 with a tokenizer."""
    base = tmp_path_factory.mktemp("embed-server") / "qwen3"
    shutil.copytree(tiny_checkpoints("qwen3")[0], base)
    make_tokenizer(384).save_pretrained(str(base))
    return base


@pytest.fixture(scope="module")
def server(path):
    from pagedjax.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(path), stream_text=True, **ENGINE)
    with running_server(engine) as s:
        s.client = openai_client(s.url).with_options(timeout=120)
        s.http = httpx.Client(base_url=s.url, timeout=120)
        yield s
        s.http.close()


@pytest.fixture(scope="module")
def offline(server, path):
    """TEXTS' token ids and their embeddings from transformers' base model (last token, after
    the final norm, L2-normalized: the engine's default pooling for this checkpoint)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path)).eval()
    ids = [server.engine.tokenizer.encode(t) for t in TEXTS]
    want = []
    for x in ids:
        with torch.no_grad():
            v = model(torch.tensor([x])).last_hidden_state[0, -1].numpy()
        want.append(v / np.linalg.norm(v))
    return ids, want


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_float_and_base64_match_the_offline_embeddings(server, offline):
    ids, want = offline
    got = {}
    for fmt in ("float", "base64"):
        resp = server.client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=fmt)
        assert resp.object == "list" and resp.model == MODEL
        assert [d.index for d in resp.data] == [0, 1, 2] and all(d.object == "embedding" for d in resp.data)
        # asked for explicitly, base64 comes back as sent: little-endian float32 bytes
        got[fmt] = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64"
                    else np.asarray(d.embedding, np.float32) for d in resp.data]
        for g, w in zip(got[fmt], want):
            assert g.shape == (64,) and cosine(g, w) > 0.9999
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    for a, b in zip(got["float"], got["base64"]):  # the same float32 values, bit for bit
        np.testing.assert_array_equal(a, b)
    # the openai client's default: it asks for base64 itself and decodes it
    resp = server.client.embeddings.create(model=MODEL, input=TEXTS[0], user="ignored")
    np.testing.assert_array_equal(np.asarray(resp.data[0].embedding, np.float32), got["float"][0])


def test_raw_shape_token_inputs_and_dimensions(server, offline):
    ids, want = offline
    body = server.http.post("/v1/embeddings", json={"input": ids[0], "model": MODEL}).json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}
    assert body["data"][0].keys() == {"object", "index", "embedding"}
    assert cosine(body["data"][0]["embedding"], want[0]) > 0.9999
    resp = server.client.embeddings.create(model=MODEL, input=ids, dimensions=8, encoding_format="float")
    for d in resp.data:
        assert len(d.embedding) == 8 and abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    assert cosine(resp.data[1].embedding, want[1][:8]) > 0.9999  # the first 8 values, renormalized
    stats = server.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [5] * 129}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [999]}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_bad_input_is_a_400(server, body, param):
    r = server.http.post("/v1/embeddings", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["param"] == param and err["message"]


def test_the_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client.embeddings.create(model=MODEL, input=[[3] * 200])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        server.client.embeddings.create(model=MODEL, input="hi", dimensions=1000)


def test_embeddings_alongside_completions(server, offline):
    """Completions streaming while embeddings run: both answer, the pool ends full."""
    import concurrent.futures

    ids, want = offline
    alone = server.client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        comp = pool.submit(lambda: server.client.completions.create(
            model=MODEL, prompt=TEXTS[1], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}))
        embs = [pool.submit(server.client.embeddings.create, model=MODEL, input=TEXTS) for _ in range(3)]
        assert comp.result().choices[0].text == alone
        for e in embs:
            for d, w in zip(e.result().data, want):
                assert cosine(d.embedding, w) > 0.9999
    stats = server.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
