"""SchedulerOutput: one step's work, as the scheduler hands it to the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.core.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: entry i computes tokens [starts[i], starts[i] + q_lens[i]) of
    requests[i]. The first `num_decode` entries are decode tokens (one each), the rest
    prompt chunks; each request appears at most once."""

    requests: list[Request]
    starts: list[int]
    q_lens: list[int]
    num_decode: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    # speculative decoding: the draft tokens each entry verifies after its decode token (its
    # q_len is 1 + len(drafts)); empty when no entry of the step has drafts
    drafts: list[list[int]] = field(default_factory=list)
    # the host KV tier (KVOffloadPolicy; empty when off), both run before the step, saves first:
    # evicted prefix blocks (device block, key) copied to the host, and host hits (key, device block) copied in
    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[bytes, int]] = field(default_factory=list)
    # the disk KV tier: full blocks computed by earlier steps (device block, key), written through to disk
    writes: list[tuple[int, bytes]] = field(default_factory=list)

    def num_drafts(self, i: int) -> int:
        return len(self.drafts[i]) if self.drafts else 0

    def row_offsets(self) -> list[int]:
        """Each entry's first sampled row within its rank: one row per entry, plus one per draft."""
        if not self.drafts:
            return list(range(len(self.requests)))
        rows, r = [], 0
        for i in range(len(self.requests)):
            rows.append(r)
            r += 1 + self.num_drafts(i)
        return rows

    @property
    def has_prefill(self) -> bool:
        return self.num_decode < len(self.requests)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.q_lens[self.num_decode:])
