"""Multi-LoRA cost: a batch of 16 where every row has its own adapter against the base model
alone, side by side in one run.

Configurations, their runs interleaved (every engine kept alive), median of --repeats with the
spread:
- base:       an engine without LoRA, 16 requests;
- lora-off:   the LoRA engine (enable_lora, max_loras=16), the same 16 requests with no adapter
              (what enabling LoRA costs requests that use none);
- lora-16:    the LoRA engine, each of the 16 requests with its own adapter (rank --rank);
- lora-1:     the LoRA engine, all 16 requests with the same adapter.
Each request: a short prompt, then --tokens greedy tokens; throughput = generated tokens / wall
seconds. Also printed: the bytes a decode step reads (base weights, and the adapter slots the
step gathers), the memory-bound floor of the ratio.

Adapters are random, written in PEFT's format (adapter_config.json + safetensors) with numpy.

    python scripts/bench_lora.py                       # the default model, all 7 projections
    python scripts/bench_lora.py --targets q_proj,v_proj  # PEFT's default targets (the engine's
                                                          # lora_target_modules set to the same)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn",
           "In 1969, the first", "Water boils at", "A good breakfast includes", "The theory of relativity",
           "import numpy as np\n", "My favourite season is", "To make bread you need", "The largest planet",
           "Dear hiring manager,", "SELECT name FROM", "The three primary colours are", "Photosynthesis is"]


def write_random_adapter(out: Path, cfg, rank: int, targets: list[str], seed: int, std: float = 0.01) -> Path:
    """A PEFT LoRA adapter with random A and B for a model of config `cfg` (models.config)."""
    from safetensors.numpy import save_file

    from pagedjax.models.lora import target_dims

    rng = np.random.default_rng(seed)
    dims = target_dims(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            n_in, n_out = dims[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * std).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": targets}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from pagedjax.models.config import load_config
    from pagedjax.models.default_model import default_model_dir
    from pagedjax.models.lora import target_dims
    from pagedjax import LLM, LoRARequest, SamplingParams

    model = args.model or str(default_model_dir())
    cfg = load_config(model)
    targets = args.targets.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    loras = [LoRARequest(f"a{i}", i, str(write_random_adapter(tmp / f"a{i}", cfg, args.rank, targets, i)))
             for i in range(1, 17)]
    common = dict(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=256)
    base = LLM(model, **common)
    lora = LLM(model, enable_lora=True, max_loras=16, max_lora_rank=args.rank, lora_target_modules=targets, **common)
    for llm in (base, lora):
        llm.wait_for_warmup()
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    configs = {"base": (base, None), "lora-off": (lora, None), "lora-16": (lora, loras),
               "lora-1": (lora, [loras[0]] * 16)}
    for llm, lr in configs.values():  # once each: adapters read and loaded, every path run
        llm.generate(PROMPTS, greedy, lora_request=lr, use_tqdm=False)
    compiles = {name: llm.stats()["num_compilations"] for name, (llm, _) in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (llm, lr) in configs.items():
            began = time.perf_counter()
            llm.generate(PROMPTS, greedy, lora_request=lr, use_tqdm=False)
            times[name].append(time.perf_counter() - began)
    after = {name: llm.stats()["num_compilations"] for name, (llm, _) in configs.items()}

    weight_bytes = max(base.engine.weight_bytes_per_device.values())  # one device
    itemsize = np.dtype(lora.engine.model.dtype).itemsize
    per_adapter = sum(args.rank * (i + o) for t, (i, o) in target_dims(cfg).items()
                      if t in targets) * cfg.num_layers * itemsize
    tokens = len(PROMPTS) * args.tokens
    res = {"model": model, "dtype": str(lora.engine.model.dtype), "rank": args.rank, "targets": targets,
           "tokens_per_run": tokens, "weight_bytes": weight_bytes, "adapter_bytes": per_adapter,
           "memory_bound_ratio_16_adapters": weight_bytes / (weight_bytes + 16 * per_adapter),
           "compilations_during_timed_runs": {k: after[k] - compiles[k] for k in configs}, "configs": {}}
    print(f"model {model} ({res['dtype']}), adapters rank {args.rank} on {','.join(targets)}; "
          f"{len(PROMPTS)} requests x {args.tokens} tokens, {args.repeats} interleaved repeats")
    print(f"{'config':10s} {'tok/s':>8s} {'spread':>16s} {'vs base':>8s}")
    ref = statistics.median(times["base"])
    for name, ts in times.items():
        med = statistics.median(ts)
        res["configs"][name] = {"seconds": ts, "tokens_per_s": tokens / med, "vs_base": ref / med}
        print(f"{name:10s} {tokens / med:8.1f} {tokens / max(ts):7.1f}-{tokens / min(ts):<8.1f} {ref / med:8.2f}x")
    print(f"decode step reads: base weights {weight_bytes / 1e6:.0f} MB; 16 adapters {16 * per_adapter / 1e6:.0f} MB "
          f"-> memory-bound floor of lora-16 / base: {res['memory_bound_ratio_16_adapters']:.2f}x")
    print(f"compilations during the timed runs: {res['compilations_during_timed_runs']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
