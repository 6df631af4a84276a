"""PNG plots of a dense-vs-paged report (pagedjax.compare.experiment): KV use over time, and the pool
at its fullest moment. matplotlib with the Agg backend (no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

WRITTEN, INTERNAL, EXTERNAL, FREE = "#2b8a3e", "#f08c00", "#c92a2a", "#e9ecef"
EMPTY = "#ffd8a8"  # reserved for a request, holds no KV (internal fragmentation) in the block maps


def plot_utilization(report: dict, path: Path) -> Path:
    """Stacked KV budget over time per backend: written, internal waste, external waste, free;
    with the number of requests holding memory on the right axis."""
    kinds = ("dense", "paged")
    t_end = max(report[k]["timeline"][-1]["t"] for k in kinds)
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for ax, kind in zip(axes, kinds):
        run = report[kind]
        tl = run["timeline"]
        t = np.array([0.0] + [s["t"] for s in tl])
        frac = lambda key: np.array([0.0] + [s[key] / s["budget"] for s in tl])  # noqa: E731
        written, internal, external = frac("written"), frac("internal_waste"), frac("external_waste")
        free = 1.0 - written - internal - external
        ax.stackplot(t, written, internal, external, free, step="post", colors=[WRITTEN, INTERNAL, EXTERNAL, FREE],
                     labels=["KV written (tokens)", "internal fragmentation", "external fragmentation", "free"])
        ax.set_ylim(0, 1)
        ax.set_xlim(0, t_end)
        ax.set_ylabel("fraction of KV budget")
        ax.set_title(f"{kind}: {run['num_blocks']} {'slots' if kind == 'dense' else 'blocks'} of "
                     f"{run['block_size']} tokens - mean utilization {run['kv_utilization_mean']:.0%}, "
                     f"waste {run['waste_fraction']:.1%}, peak {run['peak_concurrent_requests']} requests, "
                     f"done at {tl[-1]['t']:.0f} s", fontsize=10)
        twin = ax.twinx()
        twin.step(t, [0] + [s["num_requests"] for s in tl], where="post", color="black", lw=1.0)
        twin.set_ylabel("requests holding KV")
        twin.set_ylim(0, max(report[k]["peak_concurrent_requests"] for k in kinds) * 1.1)
    axes[0].legend(loc="upper right", fontsize=8, framealpha=0.9)
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(f"KV memory over time, same budget ({report['kv_budget_tokens']} tokens) for both", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _colors(ids: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab20")
    order = sorted(set(ids), key=lambda r: (len(r), r))
    return {r: cmap(i % 20) for i, r in enumerate(order)}


def plot_block_map(report: dict, path: Path, columns: int = 32) -> Path:
    """The paged pool at its fullest moment (one cell per block, coloured by owning request,
    filled in proportion to its written rows, shared blocks hatched) beside the dense slots at
    theirs (one bar per slot of max_model_len rows)."""
    paged, dense = report["paged"], report["dense"]
    blocks = paged["block_map_at_peak"]
    rows = -(-len(blocks) // columns)
    extra = 0.8 if paged.get("kv_tiers_at_peak") else 0  # inches for the KV tier rows under the map
    fig, (ax, axd) = plt.subplots(1, 2, figsize=(14, max(4.5, 0.28 * rows + 1.5) + extra),
                                  gridspec_kw={"width_ratios": [1.15, 1]})
    colors = _colors([o for b in blocks for o in b["owners"]])
    bs = paged["block_size"]
    for i, b in enumerate(blocks):
        x, y = i % columns, rows - 1 - i // columns
        ax.add_patch(Rectangle((x, y), 0.94, 0.94, facecolor=FREE, edgecolor="none"))
        if b["owners"]:
            ax.add_patch(Rectangle((x, y), 0.94, 0.94, facecolor=EMPTY, edgecolor="none"))
            shared = len(b["owners"]) > 1
            ax.add_patch(Rectangle((x, y), 0.94, 0.94 * b["rows"] / bs, facecolor=colors[b["owners"][0]],
                                   hatch="xxx" if shared else None, edgecolor="black" if shared else "none",
                                   lw=0.6 if shared else 0))
        elif b["cached"]:
            ax.add_patch(Rectangle((x, y), 0.94, 0.94, facecolor="#dee2e6", hatch="..", edgecolor="#adb5bd", lw=0))
    tier_rows = _draw_tier_rows(ax, paged, columns)  # 0 when the paged run had no KV tier
    ax.set_xlim(-0.2, columns + 0.2)
    ax.set_ylim(-0.2 - tier_rows, rows + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    pk = paged["at_peak"]
    ax.set_title(f"paged: {len(blocks)} blocks x {bs} tokens at its fullest (t={pk['t']:.1f} s)\n"
                 f"{pk['num_requests']} requests, {pk['written']} tokens written, "
                 f"{pk['internal_waste']} empty rows in partly filled last blocks ({pk['waste_fraction']:.1%} waste)",
                 fontsize=10)
    ax.legend(handles=[Patch(facecolor="#868e96", label="rows written (colour: owning request)"),
                       Patch(facecolor=EMPTY, label="reserved for the request, empty"),
                       Patch(facecolor="#868e96", hatch="xxx", edgecolor="black", label="shared by several requests"),
                       Patch(facecolor="#dee2e6", hatch="..", label="free, still holds a cached prefix"),
                       Patch(facecolor=FREE, label="free")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)

    slots = dense["block_map_at_peak"]
    length = dense["block_size"]
    tail = dense["at_peak"]["external_waste"]
    bars = len(slots) + (1 if tail else 0)
    dcolors = _colors([o for s in slots for o in s["owners"]])
    for i, s in enumerate(slots):
        y = bars - 1 - i
        axd.add_patch(Rectangle((0, y), length, 0.8, facecolor=FREE, edgecolor="#868e96", lw=0.5))
        if s["owners"]:
            axd.add_patch(Rectangle((0, y), length, 0.8, facecolor=EMPTY, edgecolor="#868e96", lw=0.5))
            axd.add_patch(Rectangle((0, y), s["rows"], 0.8, facecolor=dcolors[s["owners"][0]], edgecolor="none"))
            axd.text(length * 0.98, y + 0.4, f"{s['rows']} / {length} rows written", ha="right", va="center",
                     fontsize=8)
    labels = [f"slot {i}" for i in range(len(slots))]
    if tail:  # the budget's remainder, too small for another slot
        axd.add_patch(Rectangle((0, 0), tail, 0.8, facecolor=EXTERNAL, alpha=0.6, edgecolor="none"))
        axd.text(tail + length * 0.02, 0.4, f"rest of the budget: {tail} rows, too few for a slot",
                 va="center", fontsize=8)
        labels.append("remainder")
    axd.set_xlim(0, length)
    axd.set_ylim(-0.3, bars + 0.1)
    axd.set_yticks([bars - 1 - i + 0.4 for i in range(bars)], labels)
    axd.set_xlabel("token row in the slot")
    dk = dense["at_peak"]
    axd.set_title(f"dense: {len(slots)} slots x {length} tokens at its fullest (t={dk['t']:.1f} s)\n"
                  f"{dk['num_requests']} requests, {dk['written']} tokens written, "
                  f"{dk['internal_waste']} reserved rows empty ({dk['waste_fraction']:.1%} waste)", fontsize=10)
    axd.legend(handles=[Patch(facecolor="#868e96", label="rows written (colour: request)"),
                        Patch(facecolor=EMPTY, label="reserved for the request, empty"),
                        Patch(facecolor=EXTERNAL, alpha=0.6, label="external fragmentation")],
               loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"The same KV budget ({report['kv_budget_tokens']} tokens), each backend at its fullest moment",
                 fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


HOST_TIER, DISK_TIER = "#1971c2", "#6741d9"


def _draw_tier_rows(ax, paged: dict, columns: int) -> float:
    """Two labelled rows under the paged block map when the run had KV tiers: the host tier's
    occupancy at the same moment (used / total blocks) and the disk tier's blocks (of its size
    bound), each a bar of the map's width filled in proportion, with the run's counters.
    Returns the height they take (0: no tier, nothing drawn)."""
    at, end = paged.get("kv_tiers_at_peak"), paged.get("kv_tiers") or {}
    if not at:
        return 0.0
    host = (f"host tier: {at['host_blocks_used']} / {at['host_blocks_total']} blocks used now; over the run "
            f"{end.get('kv_offload_saved_blocks', 0)} saved, {end.get('kv_offload_loaded_blocks', 0)} loaded back, "
            f"{end.get('kv_offload_host_hit_tokens', 0)} hit tokens") if at["host"] else "host tier: off"
    total = at["host_blocks_total"]
    rows = [("host tier", at["host_blocks_used"] / total if total else 0.0, HOST_TIER, host)]
    if at["disk"]:
        frac = at["disk_bytes"] / at["disk_max_bytes"] if at["disk_max_bytes"] else 0.0
        rows.append(("disk tier", frac, DISK_TIER,
                     f"disk tier: {at['disk_blocks']} blocks ({at['disk_bytes'] / 2**10:.0f} KiB of a "
                     f"{at['disk_max_bytes'] / 2**20:.0f} MiB bound); at the end "
                     f"{end.get('disk_kv_blocks', 0)} blocks, "
                     f"{end.get('kv_offload_disk_hit_tokens', 0)} hit tokens"))
    else:
        rows.append(("disk tier", 0.0, DISK_TIER, "disk tier: off"))
    for i, (_, frac, color, text) in enumerate(rows):
        y = -1.1 - 1.1 * i
        ax.add_patch(Rectangle((0, y), columns - 0.06, 0.8, facecolor=FREE, edgecolor="#868e96", lw=0.5))
        ax.add_patch(Rectangle((0, y), (columns - 0.06) * min(frac, 1.0), 0.8, facecolor=color, alpha=0.55,
                               edgecolor="none"))
        ax.text(0.3, y + 0.4, text, va="center", fontsize=7)
    return 2.4
