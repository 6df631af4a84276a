"""Multi-LoRA: greedy outputs of base + adapter equal transformers + peft on the same
checkpoint and adapter (two ranks, all seven projections or only q and v), a batch mixing
adapters and the base model equals each run alone, more adapters than device slots queue and
swap with no compilation, the prefix cache never shares KV across adapters, and bad adapters
get clear errors."""
import json

import numpy as np
import pytest

from lora_adapters import make_adapter, peft_model
from pagedjax.models.lora import lora_delta, stack_shape
from pagedjax import LLM, LoRARequest, SamplingParams
from tiny_models import hf_greedy

ENGINE = dict(max_num_seqs=8, max_model_len=256, block_size=8, num_blocks=160, dtype="float32",
              enable_lora=True, max_loras=2, max_lora_rank=8)
MAX_NEW = 10
# 6 and 19 tokens decode-sized (native CPU matmuls where they serve); 100 tokens: XLA's dots
PROMPTS = [[5, 17, 33, 99, 2, 7], list(range(8, 27)), [(13 * i) % 380 + 2 for i in range(100)]]
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tiny_checkpoints, tmp_path_factory):
    """(checkpoint dir, {name: LoRARequest}): rank 8 on every projection, rank 4 on q and v
    (PEFT's default targets) with rsLoRA scaling, rank 2 on the MLP only."""
    path, _ = tiny_checkpoints(request.param)
    out = tmp_path_factory.mktemp(f"lora-{request.param}")
    specs = {"r8": dict(rank=8), "r4": dict(rank=4, targets=("q_proj", "v_proj"), use_rslora=True),
             "r2": dict(rank=2, targets=("gate_proj", "up_proj", "down_proj"))}
    loras = {name: LoRARequest(name, i, str(make_adapter(path, out / name, seed=i, **kw)))
             for i, (name, kw) in enumerate(specs.items(), 1)}
    return path, loras


@pytest.fixture(scope="module")
def llm(family):
    return LLM(str(family[0]), warmup=False, **ENGINE)


@pytest.mark.parametrize("name", ["r8", "r4"])
def test_greedy_equals_transformers_with_peft(family, llm, name):
    path, loras = family
    lora = loras[name]
    ours = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
    oracle = peft_model(path, lora.lora_path)
    assert ours == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    base = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert base == [hf_greedy(peft_model(path, None), p, MAX_NEW) for p in PROMPTS]
    assert ours != base


def test_an_engine_for_q_and_v_only_serves_their_adapters(family):
    """lora_target_modules=q_proj,v_proj: stacks for those two only; the q/v adapter equals
    peft as before, and an adapter on other projections is refused."""
    path, loras = family
    llm = LLM(str(path), warmup=False, lora_target_modules=["q_proj", "v_proj"], **ENGINE)
    assert sorted(llm.engine.runner.lora_stacks) == ["q_proj", "v_proj"]
    ours = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras["r4"], use_tqdm=False))
    assert ours == [hf_greedy(peft_model(path, loras["r4"].lora_path), p, MAX_NEW) for p in PROMPTS]
    with pytest.raises(ValueError, match="serves adapters on q_proj, v_proj only"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=loras["r8"], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_target_modules must name some of"):
        LLM(str(path), warmup=False, lora_target_modules=["q", "v_proj"], **ENGINE)


def test_mixed_batch_equals_each_alone(family, llm):
    """Three adapters and the base model in one batch, with max_loras=2: the third adapter
    waits for a slot, evicting the least recently used one once its requests are done."""
    _, loras = family
    order = [None, loras["r8"], loras["r4"], loras["r2"]]
    alone = {None if lr is None else lr.lora_name: _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lr,
                                                                         use_tqdm=False)) for lr in order}
    prompts = [p for p in PROMPTS for _ in order]
    per_prompt = [lr for _ in PROMPTS for lr in order]
    mixed = _tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt, use_tqdm=False))
    for i, lr in enumerate(per_prompt):
        assert mixed[i] == alone[None if lr is None else lr.lora_name][i // len(order)], (i, lr)
    stats = llm.stats()
    assert stats["lora_slots_used"] == 2 and stats["lora_slot_loads"] >= 3
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every block back


def test_prefix_cache_is_keyed_by_the_adapter(family, llm):
    """The same prompt under another adapter hits nothing cached by the first (its KV differs);
    under the same adapter again it hits its own cached blocks."""
    _, loras = family
    prompt = [[(7 * i) % 300 + 3 for i in range(40)]]
    hits = []
    for lr in (None, loras["r8"], loras["r4"], loras["r8"]):
        before = llm.stats()["prefix_cache_hit_tokens"]
        llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), lora_request=lr, use_tqdm=False)
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 32
    adapter = llm.engine.lora.add(loras["r8"])  # a base request cannot forge the adapter's key with its salt
    before = llm.stats()["prefix_cache_hit_tokens"]
    for salt in (adapter.fingerprint, f"\x00lora:{adapter.fingerprint}"):
        llm.engine.add_request(f"forge-{salt[:3]}", prompt[0], SamplingParams(max_tokens=1), cache_salt=salt)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.stats()["prefix_cache_hit_tokens"] == before


def test_a_queued_request_keeps_its_adapter_when_its_id_is_unloaded_and_reused(family):
    """max_loras=1: a request for adapter b (id 2) waits for the slot; b is unloaded and id 2
    given to adapter c meanwhile: the queued request still runs with b, the new one with c."""
    path, loras = family
    llm = LLM(str(path), warmup=False, **{**ENGINE, "max_loras": 1})
    a, b = loras["r8"], LoRARequest("b", 2, loras["r4"].lora_path)
    c = LoRARequest("c", 2, loras["r2"].lora_path)
    alone = {lr.lora_name: _tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=lr, use_tqdm=False))[0]
             for lr in (a, b)}
    assert llm.engine.remove_lora(2)
    alone["c"] = _tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=c, use_tqdm=False))[0]
    assert llm.engine.remove_lora(2)
    engine, done = llm.engine, {}
    engine.add_request("ra", PROMPTS[0], GREEDY, lora_request=a)
    engine.add_request("rb", PROMPTS[0], GREEDY, lora_request=b)
    engine.step()  # ra holds the one slot, rb waits
    assert engine.remove_lora(2)
    engine.add_request("rc", PROMPTS[0], GREEDY, lora_request=c)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done == {"ra": alone["r8"], "rb": alone["b"], "rc": alone["c"]}
    assert len({tuple(t) for t in done.values()}) == 3


def test_no_compilation_after_warmup_when_adapters_load_swap_and_mix(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    loras = [LoRARequest(f"a{i}", i, str(make_adapter(path, tmp_path / f"a{i}", rank, seed=i)))
             for i, rank in ((1, 8), (2, 3), (3, 5))]
    llm = LLM(str(path), **{**ENGINE, "max_num_batched_tokens": 64})
    llm.wait_for_warmup()
    before = llm.stats()["num_compilations"]
    for batch in ([loras[0]] * 3, [None, loras[1], loras[2]], [loras[2], loras[0], loras[1]]):
        llm.generate(PROMPTS, GREEDY, lora_request=batch, use_tqdm=False)
    stats = llm.stats()
    assert stats["lora_slot_loads"] >= 4  # three adapters through two slots
    assert stats["num_compilations"] == before


def test_adapters_beyond_the_host_cache_are_read_again(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    loras = [LoRARequest(f"a{i}", i, str(make_adapter(path, tmp_path / f"a{i}", 4, seed=i))) for i in (1, 2, 3)]
    llm = LLM(str(path), warmup=False, **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1})
    first = _tokens(llm.generate(PROMPTS[:1] * 3, GREEDY, lora_request=loras, use_tqdm=False))
    again = _tokens(llm.generate(PROMPTS[:1] * 3, GREEDY, lora_request=loras[::-1], use_tqdm=False))
    assert first == again[::-1] and len({tuple(t) for t in first}) == 3
    assert llm.stats()["lora_adapters_in_host_memory"] == 1 and llm.stats()["lora_disk_loads"] >= 4


def test_lora_delta_equals_numpy_per_token():
    rng = np.random.default_rng(0)
    slots_n, r, n_in, n_out, t = 5, 4, 24, 40, 33
    a = rng.normal(size=(slots_n, r, n_in)).astype(np.float32)
    b = rng.normal(size=(n_out, slots_n, r)).astype(np.float32)
    x = rng.normal(size=(t, n_in)).astype(np.float32)
    slots = rng.integers(0, slots_n + 1, size=t).astype(np.int32)  # 0: no adapter
    want = np.stack([np.zeros(n_out) if s == 0 else b[:, s - 1] @ (a[s - 1] @ x[i]) for i, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(lora_delta(x, a, b, slots)), want, rtol=1e-4, atol=1e-4)
    # CPU: slots x rank a multiple of 32, the smallest such
    assert [stack_shape(n, rank) for n, rank in ((16, 16), (2, 8), (3, 5), (4, 17), (1, 64))] == \
        [(16, 16), (2, 16), (4, 8), (4, 24), (1, 64)]


# -- errors ---------------------------------------------------------------------------------
def test_lora_request_needs_enable_lora(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    lora = LoRARequest("a", 1, str(make_adapter(path, tmp_path / "a", 4)))
    llm = LLM(str(path), warmup=False, **{**ENGINE, "enable_lora": False})
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=lora, use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_bad_adapters_are_refused_with_the_reason(tiny_checkpoints, tmp_path):
    llama, _ = tiny_checkpoints("llama")
    qwen3, _ = tiny_checkpoints("qwen3")
    llm = LLM(str(llama), warmup=False, **ENGINE)
    good = str(make_adapter(llama, tmp_path / "good", 4))
    cases = {
        "rank 16 .* exceeds max_lora_rank=8": str(make_adapter(llama, tmp_path / "big", 16)),
        "do not fit the model": str(make_adapter(qwen3, tmp_path / "other", 4)),
        "no adapter_config.json": str(tmp_path / "missing"),
    }
    dora = make_adapter(llama, tmp_path / "dora", 4)
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    cases["use_dora=true adapters are not supported"] = str(dora)
    for i, (message, adapter) in enumerate(cases.items(), 1):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, adapter), use_tqdm=False)
    llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("good", 1, good), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'good'"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("other", 1, str(dora)), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, good)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(llama), warmup=False, **{**ENGINE, "max_cpu_loras": 1})
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing left queued or held


def test_default_model_with_a_random_adapter_equals_transformers_with_peft(default_model_path, default_tokenizer,
                                                                            tmp_path):
    """SmolLM2-135M-Instruct with a rank-16 adapter on every projection (float32 both sides)."""
    adapter = make_adapter(default_model_path, tmp_path / "smol", 16, std=0.02, seed=3)
    prompts = [default_tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    llm = LLM(default_model_path, warmup=False, max_num_seqs=4, max_model_len=128, num_blocks=64, dtype="float32",
              enable_lora=True, max_loras=1, max_lora_rank=16)
    lora = LoRARequest("smol", 1, str(adapter))
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    oracle = peft_model(default_model_path, adapter)
    assert _tokens(outs) == [hf_greedy(oracle, p, 16) for p in prompts]
    base = llm.generate(prompts, params, use_tqdm=False)
    # the adapter changes the model (its greedy tokens may still agree with the base model's)
    first = [[next(iter(o.outputs[0].logprobs[0].values())) for o in run] for run in (outs, base)]
    assert max(abs(a - b) for a, b in zip(*first)) > 1e-3, first
