"""LLM.embed: prefill-only requests through the scheduler, pooled on the device; checked
against transformers' base model (Qwen3Model's last_hidden_state, after the final norm)."""
import json
import shutil

import numpy as np
import pytest

from pagedjax import LLM, PoolingParams, SamplingParams
from pagedjax.pooling.params import checkpoint_pooling_type, resolve_pooling_type

CHUNK = 32  # max_num_batched_tokens: longer prompts are prefilled in several steps
ENGINE = dict(max_model_len=256, block_size=8, max_num_batched_tokens=CHUNK, max_num_seqs=4)
LENGTHS = (1, 5, 17, 70, 33)


def _prompts(seed: int, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 384, size=k).tolist() for k in lengths]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    return tiny_checkpoints("qwen3")[0]


@pytest.fixture(scope="module")
def hf_base(qwen3):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(qwen3)).eval()


@pytest.fixture(scope="module")
def llm(qwen3):
    llm = LLM(str(qwen3), **ENGINE)
    llm.wait_for_warmup()
    return llm


def hf_hidden(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


def hf_embedding(model, ids, pooling: str, normalize: bool = True) -> np.ndarray:
    h = hf_hidden(model, ids)
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / np.linalg.norm(v) if normalize else v


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_pool_full(llm):
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert not llm.engine.pooler.requests


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_matches_transformers(llm, hf_base, pooling):
    prompts = _prompts(1)
    assert max(map(len, prompts)) > CHUNK
    outs = llm.embed(prompts, PoolingParams(pooling_type=pooling), use_tqdm=False)
    cosines = []
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt and out.finished
        assert out.embedding.dtype == np.float32 and out.embedding.shape == (64,)
        assert abs(np.linalg.norm(out.embedding) - 1) < 1e-5
        cosines.append(cosine(out.embedding, hf_embedding(hf_base, prompt, pooling)))
    print(f"{pooling} pooling cosines vs transformers: {[round(c, 7) for c in cosines]}")
    assert min(cosines) > 0.9999
    assert_pool_full(llm)


def test_default_pooling_is_last_without_a_sentence_transformers_config(llm, hf_base):
    prompt = _prompts(2, (9,))[0]
    (out,) = llm.embed(prompt, use_tqdm=False)  # one token-id list is one prompt
    assert llm.engine.pooler.pooling_type == "last"
    assert cosine(out.embedding, hf_embedding(hf_base, prompt, "last")) > 0.9999


def test_normalize_and_dimensions(llm, hf_base):
    prompt = _prompts(3, (40,))[0]
    raw = hf_embedding(hf_base, prompt, "last", normalize=False)
    (out,) = llm.embed([prompt], normalize=False, use_tqdm=False)
    np.testing.assert_allclose(out.embedding, raw, rtol=1e-3, atol=1e-4)
    (out,) = llm.embed([prompt], dimensions=16, use_tqdm=False)
    assert out.embedding.shape == (16,)
    np.testing.assert_allclose(out.embedding, raw[:16] / np.linalg.norm(raw[:16]), rtol=1e-3, atol=1e-5)
    (out,) = llm.embed([prompt], PoolingParams(dimensions=64, pooling_type="mean"), use_tqdm=False)
    assert cosine(out.embedding, hf_embedding(hf_base, prompt, "mean")) > 0.9999
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed([prompt], dimensions=bad, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        llm.embed([prompt], PoolingParams(), dimensions=8, use_tqdm=False)
    assert_pool_full(llm)


def test_prefix_cache_hits(llm, hf_base):
    """Last-token pooling reads cached blocks and gives the same embedding; mean pooling
    never reads the cache (it needs every token's hidden state)."""
    prompt = _prompts(4, (45,))[0]
    first, = llm.embed([prompt], use_tqdm=False)
    again, = llm.embed([prompt], use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 40
    assert cosine(first.embedding, again.embedding) > 0.99999
    mean, = llm.embed([prompt], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert mean.num_cached_tokens == 0
    assert cosine(mean.embedding, hf_embedding(hf_base, prompt, "mean")) > 0.9999
    # a generation request sharing the prompt hits the blocks an embedding computed
    out, = llm.generate([prompt + [7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out.num_cached_tokens == 40
    assert_pool_full(llm)


def test_no_compilations_after_the_first_embedding(llm):
    llm.embed(_prompts(5, (3,)), use_tqdm=False)  # the Pooler (and its executables) exists by now
    before = llm.stats()["num_compilations"]
    llm.embed(_prompts(6, (2, 31, 64, 100, 7)), use_tqdm=False)
    llm.embed(_prompts(7, (90, 1, 12)), PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert llm.stats()["num_compilations"] == before


def test_generation_alongside_embeddings_is_unchanged(llm, hf_base):
    """Embedding and generation requests in the same steps: the generated tokens are those of
    a run without embeddings, the embeddings those of transformers, no block is leaked."""
    gen_prompts = _prompts(8, (6, 50, 13))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(gen_prompts, params, use_tqdm=False)]
    emb_prompts = _prompts(9, (70, 4, 38, 21))
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, params)
        pooling = "mean" if i % 2 else "last"
        engine.add_embed_request(f"e{i}", emb_prompts[i], PoolingParams(pooling_type=pooling))
    engine.add_embed_request("e3", emb_prompts[3], PoolingParams(pooling_type="mean"))
    done = {}
    steps_with_both = 0
    while engine.has_unfinished_requests():
        before = {r.request_id for r in engine.scheduler.running}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps_with_both += any(r.startswith("e") for r in before) and any(r.startswith("g") for r in before)
    assert steps_with_both > 0
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(3)] == alone
    for i, p in enumerate(emb_prompts):
        pooling = "mean" if i % 2 else "last"
        assert done[f"e{i}"].prompt_token_ids == p
        assert cosine(done[f"e{i}"].embedding, hf_embedding(hf_base, p, pooling)) > 0.9999
    assert_pool_full(llm)


def test_prompt_limits_and_abort(llm, hf_base):
    engine = llm.engine
    full = _prompts(10, (256,))[0]  # an embedding may fill max_model_len (nothing is generated)
    (out,) = llm.embed([full], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert cosine(out.embedding, hf_embedding(hf_base, full, "mean")) > 0.9999
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([full + [5]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    assert not engine.pooler.requests
    engine.add_embed_request("abort-me", _prompts(11, (90,))[0])
    engine.step()  # its first chunk
    with pytest.raises(ValueError, match="already in use"):
        engine.add_embed_request("abort-me", [3, 4])
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        assert not engine.step()
    assert_pool_full(llm)


def test_preempted_mean_pooled_prompt_starts_over(qwen3, hf_base):
    """A pool too small for everything at once: a mean-pooled prompt preempted mid-prefill is
    computed again from its first token, and its embedding is still right."""
    llm = LLM(str(qwen3), **{**ENGINE, "num_blocks": 16, "max_model_len": 128}, warmup=False)
    engine = llm.engine
    preempted = []
    real = engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.request_id), real(req))
    gen = _prompts(12, (30, 30))
    for i, p in enumerate(gen):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    emb = _prompts(13, (60,))[0]
    done = {}
    for step in range(200):
        if step == 3:
            engine.add_embed_request("e", emb, PoolingParams(pooling_type="mean"))
        if not engine.has_unfinished_requests() and step > 3:
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "e" in preempted
    assert cosine(done["e"].embedding, hf_embedding(hf_base, emb, "mean")) > 0.9999
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 16


def _st_checkpoint(root, modes: dict, with_modules: bool = True):
    (root / "1_Pooling").mkdir(parents=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    if with_modules:
        (root / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return root


def test_sentence_transformers_pooling_config(tmp_path):
    off = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False}
    assert checkpoint_pooling_type(None) is None
    assert checkpoint_pooling_type(tmp_path) is None
    mean = _st_checkpoint(tmp_path / "mean", {**off, "pooling_mode_mean_tokens": True})
    last = _st_checkpoint(tmp_path / "last", {**off, "pooling_mode_lasttoken": True}, with_modules=False)
    cls = _st_checkpoint(tmp_path / "cls", {**off, "pooling_mode_cls_token": True})
    assert checkpoint_pooling_type(mean) == "mean" and checkpoint_pooling_type(last) == "last"
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        checkpoint_pooling_type(cls)
    assert resolve_pooling_type(None, mean) == "mean"
    assert resolve_pooling_type("last", mean) == "last"  # the engine option wins
    assert resolve_pooling_type(None, tmp_path) == "last"


def test_engine_reads_the_checkpoint_pooling(qwen3, hf_base, tmp_path):
    path = tmp_path / "st"
    shutil.copytree(qwen3, path)
    _st_checkpoint(path, {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    llm = LLM(str(path), **ENGINE, warmup=False)
    prompt = _prompts(14, (20,))[0]
    (out,) = llm.embed([prompt], use_tqdm=False)
    assert llm.engine.pooler.pooling_type == "mean"
    assert cosine(out.embedding, hf_embedding(hf_base, prompt, "mean")) > 0.9999
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(str(path), pooling_type="cls", warmup=False)


def test_a_base_model_checkpoint_without_lm_head_embeds(qwen3, hf_base, tmp_path):
    """Embedding checkpoints are often saved as the base model (Qwen3Model): tensor names
    without "model.", no lm_head."""
    from safetensors.numpy import load_file

    path = tmp_path / "base"
    hf_base.save_pretrained(path)
    for f in qwen3.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    names = set(load_file(path / "model.safetensors"))
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    llm = LLM(str(path), **ENGINE, warmup=False)
    prompt = _prompts(15, (23,))[0]
    (out,) = llm.embed([prompt], use_tqdm=False)
    assert cosine(out.embedding, hf_embedding(hf_base, prompt, "last")) > 0.9999
