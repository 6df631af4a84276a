"""The host KV tier under tensor and data parallelism on 4 virtual CPU devices (tp=2, dp=2;
int8 pool: pages and scales split over the KV heads, each data rank its own pool; one host
tier for both ranks; with a disk tier, then a restarted disk-only engine on its folder), in a
process of its own (the device count is set before jax
is imported); started by test_kv_offload.py. Prints one `RESULT {json}` line.

    python tests/engine/kv_offload_tp_case.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_kv_offload
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from test_kv_offload import _engine, _mixed_workload  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402


def main(out_dir: Path) -> dict:
    path = out_dir / "tiny-llama"
    make_checkpoint("llama", path)
    result = {}
    folder = str(out_dir / "kv-disk")
    for tier, disk in ((None, None), (0.01, folder), ("restart", folder)):  # 12 blocks per rank: docs evicted
        engine = _engine(path, tensor_parallel_size=2, data_parallel_size=2, kv_cache_dtype="int8",
                         num_blocks=12, kv_offload_gb=tier if tier != "restart" else None, kv_offload_dir=disk)
        outs = _mixed_workload(engine)  # 8 requests at a time: both ranks busy
        if disk is not None:
            engine.close_kv_tiers()
        run = {"outputs": outs, "stats": {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))},
               "kv_sharding": str(engine.runner.kv[0].data.sharding.spec), "free": [p.num_free for p in engine.pools],
               "stats_by_rank": engine.stats()["data_parallel_ranks"]}
        if tier == 0.01:
            for pool in engine.pools:
                pool.check_invariants()
            engine.kv_tiers.host.check_invariants()
            run["host_spec"] = engine.kv_tiers.host.spec.describe()
        result[str(tier)] = run
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))))
