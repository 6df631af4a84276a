"""The KV tiers (host memory `kv_offload_gb`, disk `kv_offload_dir`) in the dense-vs-paged
experiment: their occupancy sampled at the paged pool's fullest moment, their counters at the
end of the run, and the markdown rows that show them next to the device pool's. Nothing here
runs when the tiers are off (the report then has no tier keys)."""
from __future__ import annotations

from pagedjax.engine.engine_stats import kv_offload_stats

TIER_PREFIXES = ("kv_offload_", "host_kv_", "disk_kv_")


def tier_engine_kwargs(kv_offload_gb: float | None, kv_offload_dir: str | None,
                       kv_offload_disk_gb: float | None) -> dict:
    """The LLMEngine arguments of the tiers asked for; {} when none is (tiers off)."""
    out = {"kv_offload_gb": kv_offload_gb, "kv_offload_dir": kv_offload_dir, "kv_offload_disk_gb": kv_offload_disk_gb}
    if kv_offload_disk_gb is not None and kv_offload_dir is None:
        raise ValueError("kv_offload_disk_gb bounds the disk tier: give kv_offload_dir too")
    return {k: v for k, v in out.items() if v is not None}


def tier_sample(engine) -> dict | None:
    """The tiers' occupancy now (host blocks used / total, disk blocks / bytes / bound), or
    None when the engine has no tier."""
    tiers = getattr(engine, "kv_tiers", None)
    if tiers is None:
        return None
    s = tiers.stats()
    disk = getattr(tiers, "disk", None)
    return {"host_blocks_used": s.get("host_kv_blocks_used", 0), "host_blocks_total": s.get("host_kv_blocks_total", 0),
            "disk_blocks": s.get("disk_kv_blocks", 0), "disk_bytes": s.get("disk_kv_bytes", 0),
            "disk_max_bytes": disk.max_bytes if disk is not None else 0, "disk": disk is not None,
            "host": getattr(tiers, "host", None) is not None}


def tier_counters(engine) -> dict:
    """Every tier counter of `llm.stats()` (keys kv_offload_*, host_kv_*, disk_kv_*) and the
    device pool's (blocks total / cached, prefix-cache hit tokens) beside them; {} when off."""
    counters = kv_offload_stats(engine)
    if not counters:
        return {}
    pools, scheds = engine.pools, engine.schedulers
    device = {"device_kv_blocks_total": sum(p.num_blocks for p in pools),
              "device_kv_blocks_cached": sum(p.num_cached for p in pools),
              "device_prefix_cache_hit_tokens": sum(s.prefix_cache_hit_tokens for s in scheds)}
    return {**device, **{k: v for k, v in counters.items() if k.startswith(TIER_PREFIXES)}}


TIER_ROWS = [  # (label, key in run["kv_tiers"], format); shown when the paged run had tiers
    ("device pool: blocks (cached at the end)", None, None),
    ("device prefix-cache hit tokens", "device_prefix_cache_hit_tokens", "{:d}"),
    ("host tier: blocks used / total (end)", None, None),
    ("blocks saved to the host tier / loaded back", None, None),
    ("host-tier hit tokens", "kv_offload_host_hit_tokens", "{:d}"),
    ("disk tier: blocks (written through)", None, None),
    ("disk-tier hit tokens", "kv_offload_disk_hit_tokens", "{:d}"),
]


def _cell(t: dict, label: str, key: str | None, fmt: str | None) -> str:
    get = lambda k: t.get(k, "-")  # noqa: E731
    if key is not None:
        return fmt.format(t[key]) if key in t else "-"
    if label.startswith("device pool"):
        return f"{get('device_kv_blocks_total')} ({get('device_kv_blocks_cached')})"
    if label.startswith("host tier"):
        return f"{get('host_kv_blocks_used')} / {get('host_kv_blocks_total')}" if "host_kv_blocks_total" in t else "-"
    if label.startswith("blocks saved"):
        return f"{get('kv_offload_saved_blocks')} / {get('kv_offload_loaded_blocks')}"
    return f"{get('disk_kv_blocks')} ({get('kv_offload_written_blocks')})" if "disk_kv_blocks" in t else "-"


def tier_table_rows(report: dict, int8_column: bool) -> list[str]:
    """Markdown rows of the tiers in markdown_table's layout (| label | dense | paged | ratio |
    and, int8_column, | int8 | ratio |); a run without tiers shows '-', ratio cells stay
    empty; [] when no run had tiers."""
    kinds = ("dense", "paged", "paged_int8kv") if int8_column else ("dense", "paged")
    runs = [report.get(k) or {} for k in kinds]
    if not any(r.get("kv_tiers") for r in runs):
        return []
    lines = []
    for label, key, fmt in TIER_ROWS:
        cells = [_cell(r["kv_tiers"], label, key, fmt) if r.get("kv_tiers") else "-" for r in runs]
        line = f"| {label} | {cells[0]} | {cells[1]} | |"
        lines.append(line + (f" {cells[2]} | |" if int8_column else ""))
    return lines
