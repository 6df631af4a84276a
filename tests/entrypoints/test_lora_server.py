"""Multi-LoRA serving over real uvicorn and the real engine: adapters listed as models, picked
by the request's `model`, loaded and unloaded at run time (vLLM's endpoints), and
`serve --lora-modules`; the outputs match the offline LLM with the same adapter."""
import logging
import shutil

import httpx
import openai
import pytest

from lora_adapters import make_adapter
from tiny_models import make_tokenizer

from pagedjax.entrypoints.cli import main
from pagedjax.entrypoints.openai.api_server import load_lora_modules

from .openai.conftest import MODEL, openai_client, running_server

KEY = "lora-secret"
PROMPT = "hello world"
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32", max_model_len=128, num_blocks=64,
              block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def paths(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a tokenizer, adapters a1 (rank 8), a2 (rank 4), big (rank 32 > max)."""
    root = tmp_path_factory.mktemp("lora-server")
    base = root / "base"
    shutil.copytree(tiny_checkpoints("llama")[0], base)
    tok = make_tokenizer(384)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(base))
    adapters = {name: make_adapter(base, root / name, rank, seed=seed)
                for name, rank, seed in (("a1", 8, 1), ("a2", 4, 2), ("big", 32, 3))}
    return {"base": base, **{k: str(v) for k, v in adapters.items()}}


@pytest.fixture(scope="module")
def offline(paths):
    """The greedy tokens of PROMPT from the offline LLM (each decoded alone, as the server's
    logprobs show them): the base model (None) and each adapter."""
    from pagedjax import LLM, LoRARequest, SamplingParams

    llm = LLM(str(paths["base"]), warmup=False, **ENGINE)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    loras = {None: None, **{name: LoRARequest(name, i, paths[name]) for i, name in enumerate(("a1", "a2"), 1)}}
    tokens = {}
    for name, lora in loras.items():
        ids = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
        tokens[name] = [llm.tokenizer.decode([t]) for t in ids]
    return tokens


@pytest.fixture(scope="module")
def server(paths):
    from pagedjax.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(paths["base"]), stream_text=True, **ENGINE)
    assert load_lora_modules(engine, [("a1", paths["a1"])])  # what `serve --lora-modules a1=PATH` does
    with running_server(engine, api_key=KEY) as s:
        s.client = openai_client(s.url, api_key=KEY).with_options(timeout=120)
        s.http = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        yield s
        s.http.close()


def complete(server, model: str | None) -> openai.types.Completion:
    """PROMPT's greedy completion with `model` (None: the field sent as null)."""
    extra = {"ignore_eos": True, **({} if model is not None else {"model": None})}
    return server.client.completions.create(model=model or MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=0, extra_body=extra)


def tokens(completion: openai.types.Completion) -> list[str]:
    return completion.choices[0].logprobs.tokens


def load(server, name: str, path: str) -> httpx.Response:
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def unload(server, name: str) -> httpx.Response:
    return server.http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_models_list_the_base_model_and_each_adapter(server, paths):
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL, "a1"]
    a1 = models[1].model_dump()
    assert a1["parent"] == MODEL and a1["root"] == paths["a1"] and a1["object"] == "model"
    assert models[0].model_dump()["parent"] is None
    assert server.client.models.retrieve("a1").model_dump()["root"] == paths["a1"]
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("a2")


def test_the_model_name_picks_the_adapter(server, offline):
    base, adapted = complete(server, MODEL), complete(server, "a1")
    assert tokens(base) == offline[None] and base.model == MODEL
    assert tokens(adapted) == offline["a1"] and adapted.model == "a1"
    assert offline["a1"] != offline[None]
    assert tokens(complete(server, None)) == offline[None]  # no model: the base model
    # chat and streaming: the adapter's text and name too
    msgs = [{"role": "user", "content": PROMPT}]
    chat = {m: server.client.chat.completions.create(model=m, messages=msgs, max_tokens=6, temperature=0)
            for m in (MODEL, "a1")}
    assert chat["a1"].model == "a1" and chat["a1"].choices[0].message.content != chat[MODEL].choices[0].message.content
    chunks = list(server.client.chat.completions.create(model="a1", messages=msgs, max_tokens=6, temperature=0,
                                                        stream=True))
    assert {c.model for c in chunks} == {"a1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat["a1"].choices[0].message.content


def test_load_and_unload_round_trip(server, paths, offline):
    r = load(server, "a2", paths["a2"])
    assert r.status_code == 200 and "a2" in r.text
    assert [m.id for m in server.client.models.list().data] == [MODEL, "a1", "a2"]
    assert server.async_engine.loras["a2"].lora_int_id == 2  # the largest id + 1
    assert tokens(complete(server, "a2")) == offline["a2"]
    r = unload(server, "a2")
    assert r.status_code == 200 and "a2" in r.text
    assert [m.id for m in server.client.models.list().data] == [MODEL, "a1"]
    with pytest.raises(openai.NotFoundError):
        complete(server, "a2")
    assert load(server, "a2", paths["a2"]).status_code == 200  # loads again, its id reused
    assert tokens(complete(server, "a2")) == offline["a2"]
    assert unload(server, "a2").status_code == 200
    assert tokens(complete(server, "a1")) == offline["a1"]  # the other adapter is untouched
    metrics = server.http.get("/metrics").text
    for name in ("pagedjax:lora_slot_loads_total", "pagedjax:lora_disk_loads_total", "pagedjax:lora_slots_used",
                 "pagedjax:max_loras"):
        assert f"\n{name} " in metrics, name


def _error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert all(w in error["message"] for w in words), error
    return error


def test_adapter_errors(server, paths):
    _error(load(server, "bad", "/nonexistent/adapter"), 400, "no adapter_config.json")
    _error(load(server, "big", paths["big"]), 400, "exceeds max_lora_rank=16")
    _error(load(server, "a1", paths["a2"]), 400, "already loaded")
    _error(load(server, MODEL, paths["a2"]), 400, "base model")
    _error(server.http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    assert _error(unload(server, "nope"), 404, "nope")["type"] == "not_found_error"
    assert [m.id for m in server.client.models.list().data] == [MODEL, "a1"]  # nothing half-loaded
    with pytest.raises(openai.NotFoundError) as e:
        complete(server, "nope")
    assert e.value.body["code"] == "model_not_found"
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a1"})):
        assert _error(httpx.post(server.url + path, json=body), 401, "API key")["type"] == "authentication_error"
    assert "a1" in server.async_engine.loras and "a2" not in server.async_engine.loras


def test_a_server_without_enable_lora_refuses_adapters():
    with running_server() as s:  # a FakeEngine: no LoRA support
        http = httpx.Client(base_url=s.url)
        _error(http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}), 400, "--enable-lora")
        _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 400, "--enable-lora")
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
        http.close()


def test_serve_lora_modules_flags(paths, capsys, caplog):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--lora-modules", "a=/x"])
    assert e.value.code == 2 and "--lora-modules needs --enable-lora" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "a", "path": "/y"}'])
    assert "'a' is taken twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora", "--lora-modules", "no-path"])
    assert "expected NAME=PATH" in capsys.readouterr().err
    # a bad adapter stops the startup with a clear message, before anything compiles or listens
    with caplog.at_level(logging.ERROR, logger="pagedjax.entrypoints.openai"):
        code = main(["serve", str(paths["base"]), "--enable-lora", "--dtype", "float32", "--max-model-len", "64",
                     "--num-blocks", "16", "--no-warmup", "--lora-modules", f'{{"name": "ok", "path": "{paths["a1"]}"}}',
                     "bad=/nonexistent/adapter"])
    assert code == 2
    assert "cannot load LoRA adapter 'bad' from '/nonexistent/adapter' (--lora-modules)" in caplog.text
