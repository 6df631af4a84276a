"""Dense vs paged KV cache on one model, workload and KV memory budget, in one process.

Runs the same requests (greedy, EOS ignored) through LLMEngine(kv_cache="dense") and
LLMEngine(kv_cache="paged") with the same kv_cache_memory_gb and reports peak concurrent
requests, KV utilization, waste (internal / external fragmentation), throughput, mean and p99
latency and the paged backend's prefix-sharing savings. Writes compare.json, compare.md,
kv_utilization.png and kv_block_map.png into --out (default results/compare_kv_cache).

Default scenario (the PagedAttention paper's motivating example): max_model_len 2048, 40
requests with prompts of 32-320 tokens and outputs of 100-200 tokens, a KV budget of 9000
tokens for both backends (4 dense slots), max_num_seqs 32, the embedded SmolLM2-135M-Instruct:

    python scripts/compare_kv_cache.py                     # same as: pagedjax bench compare
    python scripts/compare_kv_cache.py --tiny              # random tiny Llama, seconds
    python scripts/compare_kv_cache.py --shared-prefix-len 256 --kv-budget-mib 512 --model DIR
    python scripts/compare_kv_cache.py --tiny --kv-offload-gb 1 --kv-offload-dir /tmp/kv  # KV tiers on the paged run
"""
import sys

from pagedjax.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
