"""One process of a two-process engine (2 virtual CPU devices each, tp = 4 across them).

    python tests/parallel/mp_worker.py CHECKPOINT_DIR COORDINATOR_PORT PROCESS_ID
Prints one line `RESULT {...}` with the greedy outputs and what the process saw.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from pagedjax.parallel.distributed import initialize  # noqa: E402

checkpoint, port, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
initialize(f"127.0.0.1:{port}", 2, pid)

import jax  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(20, 60))]
llm = LLM(checkpoint, tensor_parallel_size=4, max_num_batched_tokens=32, max_num_seqs=8, num_blocks=64,
          max_model_len=256)
outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
sampled = llm.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=3, ignore_eos=True,
                                                   logprobs=1), use_tqdm=False)
stats = llm.stats()
print("RESULT " + json.dumps({
    "process": jax.process_index(), "devices": jax.device_count(), "local_devices": jax.local_device_count(),
    "greedy": [list(o.outputs[0].token_ids) for o in outs],
    "sampled": [list(c.token_ids) for c in sampled[0].outputs],
    "kv_pool_bytes_per_device": stats["kv_pool_bytes_per_device"],
    "kv_blocks_free": stats["kv_blocks_free"], "kv_blocks_total": stats["kv_blocks_total"]}), flush=True)
