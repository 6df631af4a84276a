"""Weights from memory (load_format="dummy", weights=, update_weights), the prefix cache
dropped with them, sleep / wake-up, and scoring completions against transformers."""
import jax
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.models.weights import load_tensors_from_dir
from tiny_models import make_checkpoint

KW = dict(max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=64, warmup=False)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompts(seed=0, n=4, vocab=384):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=k).tolist() for k in (5, 17, 24, 9)[:n]]


def _greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Two random qwen3 checkpoints of the same shapes (seeds 0 and 1) and their tensors."""
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"qwen3-seed{seed}")
        make_checkpoint("qwen3", path, seed=seed)
        out.append((path, load_tensors_from_dir(path)))
    return out


@pytest.mark.parametrize("engine_kw", [{}, {"scan_layers": True}, {"quantization": "int8"}],
                         ids=["unrolled", "scan", "int8"])
def test_update_weights_equals_a_fresh_engine(two_checkpoints, engine_kw):
    (path_a, tensors_a), (path_b, tensors_b) = two_checkpoints
    prompts = _prompts()
    want_b = _greedy(LLM(str(path_b), **KW, **engine_kw), prompts)
    llm = LLM(str(path_a), load_format="dummy", **KW, **engine_kw)
    llm.update_weights({k: jax.numpy.asarray(v) for k, v in tensors_a.items()})  # jax arrays
    want_a = _greedy(LLM(str(path_a), **KW, **engine_kw), prompts)
    assert _greedy(llm, prompts) == want_a
    compiles = llm.stats()["num_compilations"]
    n = llm.update_weights(tensors_b.items())  # (name, array) pairs, numpy
    assert n > 0
    got = _greedy(llm, prompts)  # the same prompts: a stale prefix cache would serve seed-0 KV
    assert got == want_b
    assert llm.stats()["num_compilations"] == compiles  # no step compiled again; the gathers are cached
    assert llm.stats()["prefix_cache_hit_tokens"] == 0 or got == want_b


def test_partial_update_keeps_the_other_rows(two_checkpoints, tmp_path):
    """Only layer 0's k_proj and the final norm from checkpoint B: equal to an engine built
    from A's tensors with those two replaced (fused qkv keeps A's q and v rows)."""
    (path_a, tensors_a), (_, tensors_b) = two_checkpoints
    names = ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    mixed = dict(tensors_a, **{n: tensors_b[n] for n in names})
    prompts = _prompts(1)
    want = _greedy(LLM(str(path_a), weights=mixed, **KW), prompts)
    llm = LLM(str(path_a), **KW)
    before = _greedy(llm, prompts)
    llm.update_weights({n: tensors_b[n] for n in names})
    got = _greedy(llm, prompts)
    assert got == want and got != before


def test_bad_updates_change_nothing(two_checkpoints):
    (path_a, tensors_a), (_, tensors_b) = two_checkpoints
    llm = LLM(str(path_a), **KW)
    prompts = _prompts(2)
    before = _greedy(llm, prompts)
    good = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        llm.update_weights({good: tensors_b[good], "model.layers.9.mlp.up_proj.weight": tensors_b[good]})
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights({good: tensors_b[good], "model.norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="dtype"):
        llm.update_weights({good: tensors_b[good].astype(np.int32)})
    with pytest.raises(ValueError, match="given twice"):
        llm.update_weights([(good, tensors_b[good]), (good, tensors_b[good])])
    assert _greedy(llm, prompts) == before  # all or nothing
    with pytest.raises(ValueError, match="missing"):
        LLM(str(path_a), weights={good: tensors_a[good]}, **KW)


def test_update_while_requests_run_is_refused(two_checkpoints):
    (path_a, tensors_a), _ = two_checkpoints
    llm = LLM(str(path_a), **KW)
    llm.engine.add_request("r", [5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="between requests"):
        llm.update_weights(tensors_a)
    llm.engine.abort_request("r")
    llm.update_weights(tensors_a)


def _live_bytes():
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_sleep_and_wake_up(two_checkpoints):
    (path_a, _), _ = two_checkpoints
    llm = LLM(str(path_a), **KW)
    prompts = _prompts(3)
    want = _greedy(llm, prompts)
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.kv))
    weight_bytes = sum(x.nbytes for x in llm.engine.runner._weights)
    awake = _live_bytes()
    llm.sleep(level=1)
    assert awake - _live_bytes() >= kv_bytes - 4096  # (a few small arrays come and go)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.sleep(level=2)
    assert awake - _live_bytes() >= kv_bytes + weight_bytes - 4096
    compiles = llm.stats()["num_compilations"]
    llm.wake_up()
    assert _greedy(llm, prompts) == want
    assert llm.stats()["num_compilations"] == compiles
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_score_equals_transformers(tiny_checkpoints):
    """Per-token log-probs of completions, float32, within 1e-4 of a transformers forward
    pass; n completions of one prompt share its cached blocks."""
    import torch

    path, hf_model = tiny_checkpoints("qwen3")
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, 384, size=40).tolist()
    completions = [rng.integers(2, 384, size=k).tolist() for k in (1, 7, 19, 30)]
    llm = LLM(str(path), **KW)
    got = llm.score([prompt] * len(completions), completions)
    with torch.no_grad():
        for c, lp in zip(completions, got):
            ids = torch.tensor([prompt + c])
            logits = hf_model(ids).logits[0].double().log_softmax(-1)
            want = logits[len(prompt) - 1:-1].gather(-1, torch.tensor(c)[:, None])[:, 0].numpy()
            assert lp.shape == (len(c),) and lp.dtype == np.float32
            np.testing.assert_allclose(lp, want, atol=1e-4)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0  # the prompt's full blocks were read from the cache
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    with pytest.raises(ValueError, match="nothing to score"):
        llm.score([prompt], [[]])


def test_rl_shaped_generation(default_model_path):
    """GRPO-shaped: n samples of one prompt fork from its blocks, each with its sampled
    tokens' log-probs, no text when detokenize=False, reproducible from the seed."""
    llm = LLM(str(default_model_path), max_num_seqs=8, max_model_len=256, warmup=False)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, logprobs=0, detokenize=False,
                            ignore_eos=True)
    prompt = "Write a short poem about the sea."
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and llm.stats()["num_forks"] >= 3
    for seq, same in zip(out.outputs, again.outputs):
        assert seq.text == "" and len(seq.token_ids) == 12 and seq.token_ids == same.token_ids
        assert [set(lp) >= {t} for lp, t in zip(seq.logprobs, seq.token_ids)] == [True] * 12
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["\n"], detokenize=False)
