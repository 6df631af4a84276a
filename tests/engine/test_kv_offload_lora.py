"""The host KV tier with LoRA adapters: a block's key names its adapter, so a prefix evicted
under one adapter is loaded back only for a request with that adapter (never for another
adapter's, whose KV differs); greedy outputs equal to those without the tier."""
import numpy as np

from lora_adapters import make_adapter
from pagedjax import LoRARequest, SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

BS, NUM_BLOCKS, DOCS = 8, 24, 3  # a doc of 64 tokens is 8 blocks: 3 docs under 2 adapters never fit the pool


def _run(path, loras, tier):
    engine = LLMEngine(str(path), stream_text=False, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=2,
                       max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8, kv_offload_gb=tier)
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 384, 8 * BS).tolist() for _ in range(DOCS)]
    outs = {}
    for rnd, lora in enumerate([loras[0], loras[1], loras[0]]):  # adapter a, then b, then a again
        for d, doc in enumerate(docs):
            rid = f"{rnd}-{d}"
            engine.add_request(rid, doc + [7, 9, 11], SamplingParams(max_tokens=5, ignore_eos=True), lora_request=lora)
            while engine.has_unfinished_requests():
                outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return engine, outs


def test_host_tier_loads_a_prefix_only_for_its_own_adapter(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    loras = [LoRARequest(name, i + 1, str(make_adapter(path, tmp_path / name, 4, seed=i)))
             for i, name in enumerate("ab")]
    _, base = _run(path, loras, None)
    engine, outs = _run(path, loras, 0.01)
    assert outs == base  # greedy, token for token
    assert any(base[f"0-{d}"] != base[f"1-{d}"] for d in range(DOCS))  # the adapters do change the outputs
    s = engine.stats()
    # round 2 (adapter b) finds none of a's blocks; round 3 (a again) loads each doc's 8 blocks back
    assert s["kv_offload_loaded_blocks"] == DOCS * 8
    assert engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
    engine.kv_tiers.host.check_invariants()
