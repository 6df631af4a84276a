"""Gemma 2 / 3 and the mixture-of-experts families against transformers, token for token.

Tiny random checkpoints (tests/tiny_models.MORE_FAMILIES) in float32; prompts run past the
sliding window (tiny_models.WINDOW) and past the step's token budget (chunked prefill), more
prompts than sequence slots (requests join and leave mid-run).
"""
import numpy as np
import pytest

from pagedjax.models.config import load_config
from pagedjax import LLM, SamplingParams
from tiny_models import MORE_FAMILIES, WINDOW, hf_greedy

MAX_NEW = 24
LENGTHS = [1, 5, 15, 16, 17, 20, 31, 33, 40, 47, 50, 60, 64, 70, 80, 100]  # 16 prompts, most past the window
ENGINE = dict(max_num_seqs=4, max_model_len=160, block_size=8, num_blocks=160, max_num_batched_tokens=64)


def _prompts(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 384, size=k).tolist() for k in lengths]


def _greedy(llm, prompts, n=MAX_NEW):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    """family -> transformers' greedy tokens for _prompts()."""
    cache = {}

    def get(family):
        if family not in cache:
            _, model = tiny_checkpoints(family)
            cache[family] = [hf_greedy(model, p, MAX_NEW) for p in _prompts()]
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_greedy_matches_transformers_with_no_compilation_after_warmup(family, tiny_checkpoints, expected):
    path, _ = tiny_checkpoints(family)
    llm = LLM(str(path), **ENGINE)
    llm.wait_for_warmup()
    before = llm.stats()["num_compilations"]
    got = _greedy(llm, _prompts())
    assert got == expected(family)
    stats = llm.stats()
    assert stats["num_compilations"] == before
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_configs_say_what_the_families_are(tiny_checkpoints):
    g2 = load_config(tiny_checkpoints("gemma2")[0])
    assert g2.layer_windows == (WINDOW, None, WINDOW) and g2.attn_soft_cap == 5.0 and g2.final_soft_cap == 10.0
    assert g2.embed_scale == 8.0 and g2.attn_scale == 24 ** -0.5 and g2.sandwich_norms and g2.local_rope is None
    g3 = load_config(tiny_checkpoints("gemma3_text")[0])
    assert g3.qk_norm and g3.attn_soft_cap is None and g3.local_rope == (10000.0, None)
    assert g3.rope_scaling == (("rope_type", "linear"), ("factor", 4.0)) and g3.rope_theta == 1e6
    mix = load_config(tiny_checkpoints("mixtral")[0])
    assert (mix.num_experts, mix.num_experts_per_tok, mix.norm_topk_prob) == (8, 2, True)
    assert mix.layer_windows == (WINDOW, WINDOW) and mix.uniform_layers
    q3 = load_config(tiny_checkpoints("qwen3_moe")[0])
    assert q3.moe_layers == (True, False, True) and not q3.uniform_layers and q3.moe_intermediate_size == 32
    q2 = load_config(tiny_checkpoints("qwen2_moe")[0])
    assert q2.shared_expert_intermediate_size == 48 and not q2.norm_topk_prob and q2.attention_bias


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_the_window_matters(family, tiny_checkpoints, expected):
    """Against a guard that the parity above is not vacuous: the same weights without the
    window (a config edit) generate other tokens for prompts longer than the window."""
    import json
    import shutil

    path, _ = tiny_checkpoints(family)
    other = path.parent / f"{family}-nowindow"
    if not other.exists():
        shutil.copytree(path, other)
        cfg = json.loads((other / "config.json").read_text())
        cfg["sliding_window"] = 1024 if family == "gemma2" else None
        (other / "config.json").write_text(json.dumps(cfg))
    long = [i for i, n in enumerate(LENGTHS) if n > 2 * WINDOW]
    got = _greedy(LLM(str(other), warmup=False, **ENGINE), [_prompts()[i] for i in long])
    assert got != [expected(family)[i] for i in long]


@pytest.mark.parametrize("family,kw", [("mixtral", dict(scan_layers=True)), ("mixtral", dict(moe_impl="dense")),
                                       ("qwen2_moe", dict(moe_impl="ragged")), ("gemma3_text", dict(kv_cache="dense")),
                                       ("gemma2", dict(attention_impl="ragged"))])
def test_other_paths_give_the_same_tokens(family, kw, tiny_checkpoints, expected):
    """Layers under scan (all alike), every expert matmul, the dense KV cache and another
    attention kernel: the same greedy tokens."""
    path, _ = tiny_checkpoints(family)
    engine = dict(ENGINE, num_blocks=4) if kw.get("kv_cache") == "dense" else ENGINE
    idx = [0, 4, 9, 15]
    got = _greedy(LLM(str(path), warmup=False, **engine, **kw), [_prompts()[i] for i in idx])
    assert got == [expected(family)[i] for i in idx]


def test_shared_prefix_is_computed_once_and_tokens_do_not_change(tiny_checkpoints, expected):
    """Prefix caching over Gemma's sliding and full layers: a second run hits the cache."""
    path, _ = tiny_checkpoints("gemma3_text")
    llm = LLM(str(path), warmup=False, enable_prefix_caching=True, **ENGINE)
    prompts = _prompts()[10:]
    first = _greedy(llm, prompts)
    again = _greedy(llm, prompts)
    assert first == again == expected("gemma3_text")[10:]
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def _held_blocks_per_step(llm, prompts, n):
    """Steps the engine by hand: each request's tokens, and the pool's held blocks after every step."""
    engine, pool = llm.engine, llm.engine.pool
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
    held, outs = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        held.append(pool.num_blocks - pool.num_free)
        pool.check_invariants()
    assert pool.num_free == pool.num_blocks  # every reference returned once
    return [outs[str(i)] for i in range(len(prompts))], held


def test_blocks_outside_every_window_go_back_to_the_pool_and_tokens_do_not_change(tiny_checkpoints):
    """Mixtral slides in every layer (window 16, blocks of 8): a request holds at most 3 blocks
    once its prompt is in, instead of all of them; Gemma's global layers keep every block."""
    path, model = tiny_checkpoints("mixtral")
    prompts, n = _prompts(seed=3, lengths=[50, 9]), 100
    want = [hf_greedy(model, p, n) for p in prompts]
    llm = LLM(str(path), **ENGINE)
    got, held = _held_blocks_per_step(llm, prompts, n)
    assert got == want
    assert llm.stats()["kv_blocks_released_outside_window"] > 0
    keep = LLM(str(path), **ENGINE, release_window_blocks=False)
    kept, held_kept = _held_blocks_per_step(keep, prompts, n)
    assert kept == want and keep.stats()["kv_blocks_released_outside_window"] == 0
    assert max(held_kept) == -(-(50 + n) // 8) + -(-(9 + n) // 8)  # 19 + 14: the whole of both
    assert max(held) <= 7 + 2  # the first step's prompt blocks; then at most 3 per request
    assert max(held[3:]) <= 2 * 3
    # a pool smaller than either request (12 blocks < 19): the window (16) and a step (64) need 11
    small = LLM(str(path), **dict(ENGINE, num_blocks=12))
    assert small.engine.scheduler.window.max_blocks_held(64) == 11
    assert _held_blocks_per_step(small, prompts, n)[0] == want
    gemma = LLM(str(tiny_checkpoints("gemma2")[0]), **ENGINE)
    assert gemma.engine.scheduler.window is None


def test_lora_on_a_mixture_of_experts_model_targets_attention_only(tiny_checkpoints):
    path = str(tiny_checkpoints("qwen3_moe")[0])
    llm = LLM(path, enable_lora=True, warmup=False, **ENGINE)
    assert llm.engine.config.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    got = _greedy(llm, _prompts(lengths=[20]), 4)  # the step with adapter slots runs
    assert len(got[0]) == 4
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(path, enable_lora=True, lora_target_modules=["q_proj", "gate_proj"], warmup=False, **ENGINE)


def test_gemma_norms_of_a_bf16_checkpoint_are_one_plus_w_in_float32(tiny_checkpoints):
    """transformers computes Gemma's RMSNorm scale as 1 + w.float(): summed in bf16 it would
    round (1 + 0.0123 -> 1.0156)."""
    import ml_dtypes

    from pagedjax.models.loader import convert_hf_tensors
    from pagedjax.models.weights import load_tensors_from_dir

    path = tiny_checkpoints("gemma2")[0]
    tensors = {k: np.asarray(v, ml_dtypes.bfloat16) for k, v in load_tensors_from_dir(path).items()}
    tensors["model.norm.weight"][:] = np.float32(0.0123)
    arrays = convert_hf_tensors(load_config(path), tensors)
    assert arrays["norm"].dtype == np.float32
    np.testing.assert_allclose(arrays["norm"], 1 + np.float32(ml_dtypes.bfloat16(0.0123)), rtol=0, atol=1e-7)
