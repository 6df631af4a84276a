"""Gemma and mixture-of-experts models split over 8 virtual CPU devices; prints one JSON object.

Started by test_family_parallel.py in a subprocess of its own (the device count must be set
before jax is imported). Tensor parallelism (tp), and expert parallelism (ep: whole experts
split over the tp devices) with and without data parallelism, against transformers.

    python tests/parallel/family_cases.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE", "0")
os.environ.setdefault("PAGEDJAX_AUTO_DTYPE", "float32")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

import numpy as np  # noqa: E402

from tiny_models import hf_greedy, make_checkpoint  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402

MAX_NEW = 24
LENGTHS = [1, 5, 15, 16, 17, 20, 31, 33, 40, 47, 50, 60, 64, 70, 80, 100]  # 16 prompts, most past the window
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=128, max_model_len=160, block_size=8,
              warmup=False)
CASES = {  # family -> (name, engine options) beside one device
    "mixtral": [("tp2", dict(tensor_parallel_size=2)), ("ep2", dict(tensor_parallel_size=2, expert_parallel=True)),
                ("ep2_dp2", dict(tensor_parallel_size=2, data_parallel_size=2, expert_parallel=True)),
                ("ep4_ragged", dict(tensor_parallel_size=4, expert_parallel=True, moe_impl="ragged"))],
    "qwen3_moe": [("tp2", dict(tensor_parallel_size=2)), ("ep2", dict(tensor_parallel_size=2, expert_parallel=True))],
    "qwen2_moe": [("ep2", dict(tensor_parallel_size=2, expert_parallel=True))],
    "gemma2": [("tp2", dict(tensor_parallel_size=2))],
    "gemma3_text": [("tp2", dict(tensor_parallel_size=2)), ("dp2", dict(data_parallel_size=2))],
}


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, 384, size=k).tolist() for k in LENGTHS]


def greedy(llm):
    outs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def expert_rows_per_device(llm) -> list[int]:
    """Experts each device holds of the first MoE layer's gate/up stack."""
    import jax

    for path, x in jax.tree_util.tree_leaves_with_path(llm.engine.runner.state):
        if "experts_gate_up" in jax.tree_util.keystr(path):
            return sorted({s.data.shape[-3] for s in x.addressable_shards})
    return []


def main(out_dir: Path) -> dict:
    res = {}
    for family, cases in CASES.items():
        torch_model = make_checkpoint(family, out_dir / family)
        fam = res[family] = {"transformers": [hf_greedy(torch_model, p, MAX_NEW) for p in prompts()]}
        for name, kw in [("1", {})] + cases:
            llm = LLM(str(out_dir / family), **ENGINE, **kw)
            stats = llm.stats()
            fam[name] = {"tokens": greedy(llm), "experts_per_device": expert_rows_per_device(llm),
                         "blocks_leaked": stats["kv_blocks_total"] - llm.stats()["kv_blocks_free"]}
            del llm
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))))
