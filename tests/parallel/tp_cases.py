"""Runs the tensor-parallel cases on 8 virtual CPU devices and prints one JSON object.

Started by test_tensor_parallel.py in a subprocess of its own: the device count must be set
before jax is imported, so these cases cannot share a process with the rest of the suite.

    python tests/parallel/tp_cases.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from lora_adapters import make_adapter  # noqa: E402
from tiny_models import hf_greedy, make_checkpoint  # noqa: E402

from pagedjax import LLM, BeamSearchParams, LoRARequest, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(20, 60))]
# query / KV heads: llama 4 / 2, mistral 4 / 1, qwen2 4 / 4, qwen3 8 / 2 (tp 4 and 8 over 2 KV heads
# and tp 4 over 1 replicate KV heads)
TP_SIZES = {"llama": (2, 4), "mistral": (4,), "qwen2": (4,), "qwen3": (8,)}
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=64, max_model_len=256)
# engines whose compilations are not counted skip the background warm-up: its thread would go on
# compiling after `del llm`, inside the count of the engine measured next
UNCOUNTED = dict(ENGINE, warmup=False)


def greedy(llm, n_tokens=10):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


PROCESSORS = [  # penalties, bias, a token mask and prompt logprobs, batched together
    dict(max_tokens=8, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
         logit_bias={7: 3.0}),
    dict(max_tokens=8, ignore_eos=True, allowed_token_ids=[5, 6, 7, 9, 11], prompt_logprobs=2),
    dict(max_tokens=8, ignore_eos=True, temperature=0.8, seed=3, frequency_penalty=1.0, min_tokens=4),
]


def processors(llm):
    outs = llm.generate(PROMPTS, [SamplingParams(**kw) for kw in PROCESSORS], use_tqdm=False)
    plp = outs[1].prompt_logprobs
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_logprobs": [None] + [plp[i][t] for i, t in enumerate(PROMPTS[1]) if i]}


def memory(llm):
    s = llm.stats()
    total_w = sum(x.nbytes for x in _leaves(llm.engine.runner.state))
    total_kv = sum(x.nbytes for x in _leaves(llm.engine.runner.kv))  # an 8-bit pool: pages and scales
    return {"weights_per_device": s["weight_bytes_per_device"], "kv_per_device": s["kv_pool_bytes_per_device"],
            "weights_total": total_w, "kv_total": total_kv}


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def main(out_dir: Path) -> dict:
    res: dict = {"families": {}}
    for family, sizes in TP_SIZES.items():
        path = out_dir / family
        torch_model = make_checkpoint(family, path)
        fam = res["families"][family] = {}
        fam["transformers"] = [hf_greedy(torch_model, p, 10) for p in PROMPTS]
        for tp in (1, *sizes):
            llm = LLM(str(path), tensor_parallel_size=tp, **UNCOUNTED)
            fam[str(tp)] = {"tokens": greedy(llm), "memory": memory(llm)}
            del llm
    llama = str(out_dir / "llama")
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)
    beam = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    for tp in (1, 2):
        llm = LLM(llama, tensor_parallel_size=tp, scan_layers=True, **ENGINE)
        llm.wait_for_warmup()
        before = llm.stats()["num_compilations"]
        outs = llm.generate(PROMPTS, sampled, use_tqdm=False)
        case = res[f"llama_tp{tp}"] = {
            "n3": [[list(c.token_ids) for c in o.outputs] for o in outs],
            "logprobs": [[[sorted(d.items()) for d in c.logprobs] for c in o.outputs] for o in outs],
            "beam": [[list(s.token_ids) for s in b.sequences] for b in llm.beam_search(PROMPTS[:2], params=beam)],
            "greedy_scan": greedy(llm, 20),
            "processors": processors(llm),
        }
        case["compilations_after_warmup"] = llm.stats()["num_compilations"] - before
        dense = LLM(llama, tensor_parallel_size=tp, kv_cache="dense", max_num_batched_tokens=32, max_num_seqs=4,
                    num_blocks=4, max_model_len=128, warmup=False)
        case["dense"] = greedy(dense)
        del llm, dense
    for tp in (1, 2):  # bf16 matrices and KV cache; under tp the o / down partial sums are f32
        llm = LLM(llama, tensor_parallel_size=tp, dtype="bfloat16", **UNCOUNTED)
        res[f"bf16_tp{tp}"] = {"tokens": greedy(llm), "kv_dtype": str(llm.engine.runner.kv[0].dtype)}
        del llm
    for tp in (1, 2):  # int8 weights (scales sharded with their rows) and an int8 KV cache (scales with the heads)
        llm = LLM(llama, tensor_parallel_size=tp, quantization="int8", kv_cache_dtype="int8", **UNCOUNTED)
        layer = llm.engine.model.layers[0]
        out = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
        res[f"int8_tp{tp}"] = {
            "tokens": greedy(llm), "memory": memory(llm),
            "prompt_logprobs": [out.prompt_logprobs[i][t] for i, t in enumerate(PROMPTS[1]) if i],
            "scale_shards": {"wqkv": [list(x.data.shape) for x in layer.attn.wqkv_scale[...].addressable_shards],
                             "w_down": [list(x.data.shape) for x in layer.mlp.w_down_scale[...].addressable_shards]},
        }
        del llm
    adapters = [make_adapter(out_dir / "llama", out_dir / f"lora{i}", rank, seed=i) for i, rank in ((1, 8), (2, 4))]
    loras = [None, *(LoRARequest(f"a{i}", i, str(a)) for i, a in enumerate(adapters, 1))]
    for tp in (1, 2, 4):  # LoRA stacks cut like their base weights (tp 4: KV heads, and k/v's b, replicated)
        llm = LLM(llama, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8, **UNCOUNTED)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True), lora_request=loras, use_tqdm=False)
        stacks = llm.engine.runner.lora_stacks
        res[f"lora_tp{tp}"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                               # layer 0's (unrolled layers: a tuple of per-layer arrays)
                               "q_b_shards": [list(x.data.shape) for x in stacks["q_proj"][1][0].addressable_shards],
                               "o_a_shards": [list(x.data.shape) for x in stacks["o_proj"][0][0].addressable_shards],
                               "base": greedy(llm)}
        del llm
    for tp in (1, 2):  # a pool too small for all three: the newest requests are preempted and recomputed
        small = dict(UNCOUNTED, num_blocks=7)
        llm = LLM(llama, tensor_parallel_size=tp, enable_prefix_caching=False, **small)
        res[f"preempt_tp{tp}"] = {"tokens": greedy(llm, 40), "preemptions": llm.stats()["num_preemptions"]}
        del llm
    shared = list(range(100, 148))  # three blocks of 16 shared by the routing requests
    for dp, tp in ((2, 1), (2, 2)):
        llm = LLM(llama, tensor_parallel_size=tp, data_parallel_size=dp, scan_layers=True, **ENGINE)
        llm.wait_for_warmup()
        before = llm.stats()["num_compilations"]
        outs = llm.generate(PROMPTS, sampled, use_tqdm=False)
        case = res[f"llama_dp{dp}_tp{tp}"] = {
            "n3": [[list(c.token_ids) for c in o.outputs] for o in outs],
            "beam": [[list(s.token_ids) for s in b.sequences] for b in llm.beam_search(PROMPTS[:2], params=beam)],
            "greedy_scan": greedy(llm, 20),
            "processors": processors(llm),
        }
        queried = [r["prefix_cache_query_tokens"] for r in llm.stats()["data_parallel_ranks"]]
        llm.generate([shared + [i] for i in range(6)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        ranks = llm.stats()["data_parallel_ranks"]
        case["shared_prefix_query_tokens_by_rank"] = [r["prefix_cache_query_tokens"] - q for r, q in zip(ranks, queried)]
        case["ranks_before_shared"] = queried
        case["ranks_after"] = ranks
        case["compilations_after_warmup"] = llm.stats()["num_compilations"] - before
        case["memory"] = memory(llm)
        del llm
    # a draft model under data parallelism: more requests decode at once (2 ranks x 16) than one
    # step of max_num_batched_tokens holds; the draft's steps must take them all
    many = dict(ENGINE, max_num_seqs=16, max_num_batched_tokens=16, num_blocks=200, data_parallel_size=2)
    prompts = [[(7 * i + j) % 300 + 2 for j in range(3 + i % 5)] for i in range(32)]
    draft_case = res["draft_dp2"] = {}
    for label, spec in (("plain", None), ("draft", {"model": llama, "num_speculative_tokens": 3, "adaptive": False})):
        llm = LLM(llama, speculative_config=spec, **many)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        draft_case[label] = [list(o.outputs[0].token_ids) for o in outs]
        if spec:
            drafter = llm.engine.drafter
            draft_case["accepted"] = llm.stats()["spec_accepted_tokens"]
            draft_case["pools_whole"] = (drafter.num_free_blocks == drafter.cache.num_blocks and all(
                r["kv_blocks_free"] == r["kv_blocks_total"] for r in llm.stats()["data_parallel_ranks"]))
        del llm
    errors = {}
    for label, kwargs in {"tp3": dict(tensor_parallel_size=3), "tp16": dict(tensor_parallel_size=16)}.items():
        try:
            LLM(llama, **kwargs, **ENGINE)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    res["errors"] = errors
    return res


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print("RESULT " + json.dumps(main(out)))
