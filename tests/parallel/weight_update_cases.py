"""update_weights on tensor-parallel engines (4 virtual CPU devices), printed as one JSON line.

Started by test_weight_update_parallel.py in a subprocess of its own (the device count must
be set before jax is imported).

    python tests/parallel/weight_update_cases.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

import jax  # noqa: E402

from tiny_models import make_checkpoint  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.models.weights import load_tensors_from_dir  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(20, 60))]
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=4, num_blocks=64, max_model_len=128, warmup=False)


def greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(out_dir: Path) -> None:
    paths = []
    for seed in (0, 1):  # qwen3: 8 query heads, 2 KV heads (tp=4 repeats each KV head)
        paths.append(out_dir / f"qwen3-{seed}")
        make_checkpoint("qwen3", paths[-1], seed=seed)
    tensors_b = load_tensors_from_dir(paths[1])
    result = {"reference": greedy(LLM(str(paths[1]), **ENGINE))}
    for name, kw in (("tp4", dict(tensor_parallel_size=4)), ("tp2_int8", dict(tensor_parallel_size=2,
                                                                             quantization="int8"))):
        want = greedy(LLM(str(paths[1]), **ENGINE, **kw))
        llm = LLM(str(paths[0]), **ENGINE, **kw)
        before = greedy(llm)
        # jax arrays on one device: the update places them on the engine's shards
        llm.update_weights({k: jax.device_put(v, jax.devices()[0]) for k, v in tensors_b.items()})
        full = greedy(llm)
        spread = {str(d): 0 for d in jax.devices()}
        for x in llm.engine.runner._weights:
            for shard in x.addressable_shards:
                spread[str(shard.device)] += shard.data.nbytes
        result[name] = {"want": want, "before": before, "after": full, "bytes_per_device": spread}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
