"""Data-parallel routing: which rank's block pool and scheduler take a new request.

Each data rank has its own block pool and scheduler (host side), and its own share of the
step's rows and of the KV pool (device side); all ranks run in one SPMD step. A request goes
to the rank that has the longest prefix of it cached; with none cached, to the rank its
first block was sent to recently (so requests sharing a prompt that is still being computed
meet on one rank); otherwise to the least loaded rank. Sharing never outweighs balance: when
the preferred rank is a whole batch (max_num_seqs) busier than the least loaded one, the
request goes there instead, and that rank computes and caches the prefix as well.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedjax.core.block_pool import hash_block
from pagedjax.core.request import Request
from pagedjax.core.sched.scheduler import Scheduler

_AFFINITY_ENTRIES = 4096  # first-block keys remembered


class DataParallelRouter:
    def __init__(self, schedulers: list[Scheduler]):
        self.schedulers = schedulers
        self._rank_of_first_block: OrderedDict[bytes, int] = OrderedDict()  # first block's key -> rank

    def route(self, req: Request) -> int:
        """The rank for req (also stored in req.dp_rank)."""
        if len(self.schedulers) == 1:
            return 0
        hits = [s.num_cached_prefix_blocks(req) for s in self.schedulers]
        first = self._first_block_hash(req)
        rank = None
        if max(hits) > 0:
            rank = min((r for r, h in enumerate(hits) if h == max(hits)), key=lambda r: self.schedulers[r].load())
        elif first is not None and first in self._rank_of_first_block:
            rank = self._rank_of_first_block[first]
        least = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].load())
        slack = self.schedulers[0].buckets.max_num_seqs
        if rank is None or self.schedulers[rank].load() - self.schedulers[least].load() >= slack:
            rank = least
        if first is not None:
            self._rank_of_first_block[first] = rank
            self._rank_of_first_block.move_to_end(first)
            if len(self._rank_of_first_block) > _AFFINITY_ENTRIES:
                self._rank_of_first_block.popitem(last=False)
        req.dp_rank = rank
        return rank

    def _first_block_hash(self, req: Request) -> bytes | None:
        bs = self.schedulers[0].block_size
        if req.num_prompt_tokens <= bs:
            return None
        return hash_block(None, tuple(req.prompt_token_ids[:bs]), req.cache_salt, req.lora_key)
