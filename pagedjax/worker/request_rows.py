"""Running requests' rows kept between steps, so a decode step gathers them in a few numpy
calls instead of converting every request's Python state.

A request gets a row at its first decode step: its sampling settings are written then (a
request's SamplingParams do not change while it runs) and its block table whenever its block
ids change (a block appended, a copy-on-write, a trimmed tail, a preemption and
re-admission). Each block-table row is checked against a copy of the ids it was written from
(a list comparison, in C), so it is never stale whatever changed the request's blocks."""
from __future__ import annotations

import numpy as np

from pagedjax.core.request import Request


class RequestRows:
    def __init__(self, capacity: int, width: int):
        """capacity: rows kept (at least the sequences of one step); width: blocks per row."""
        self.table = np.zeros((capacity, width), np.int32)  # [capacity, width]: row -> block ids, 0-padded
        # [capacity] each: the row's request's sampling settings (SamplingArrays' fields of the same names)
        self.temperature, self.top_p = np.zeros(capacity, np.float32), np.ones(capacity, np.float32)
        self.min_p, self.top_k = np.zeros(capacity, np.float32), np.zeros(capacity, np.int32)
        self.seed, self.want_logprobs = np.zeros(capacity, np.uint32), np.zeros(capacity, bool)
        self.repetition, self.frequency = np.ones(capacity, np.float32), np.zeros(capacity, np.float32)
        self.presence = np.zeros(capacity, np.float32)
        self.penalized = np.zeros(capacity, bool)  # params.uses_penalties
        # mask_needed's parts: a rule (grammar, allowed or banned tokens), min_tokens
        self.has_rule, self.min_tokens = np.zeros(capacity, bool), np.zeros(capacity, np.int32)
        self.scored = np.zeros(capacity, bool)  # params.prompt_logprobs is not None
        self._row_of: dict[Request, tuple[int, list[int]]] = {}  # request -> (its row, the ids written there)
        self._free = list(range(capacity - 1, -1, -1))

    def rows(self, reqs: list[Request]) -> np.ndarray:
        """[len(reqs)] int: the rows of `reqs`, each block table up to date with its `block_ids`."""
        row_of, idx = self._row_of, []
        for req in reqs:
            entry = row_of.get(req)
            if entry is None or entry[1] != req.block_ids:
                entry = self._write(req, entry, reqs)
            idx.append(entry[0])
        return np.array(idx, np.intp)

    def _write(self, req: Request, entry, batch: list[Request]) -> tuple[int, list[int]]:
        ids = list(req.block_ids)
        if len(ids) > self.table.shape[1]:
            raise ValueError(f"request {req.request_id} holds {len(ids)} blocks; a block table row has "
                             f"room for {self.table.shape[1]}")
        if entry is None:
            row = self._take(batch)
            self._write_settings(row, req)
        else:
            row = entry[0]
        self.table[row, :len(ids)] = ids
        self.table[row, len(ids):] = 0
        entry = self._row_of[req] = (row, ids)
        return entry

    def _write_settings(self, row: int, req: Request) -> None:
        p = req.params
        self.temperature[row], self.top_p[row], self.min_p[row], self.top_k[row] = p.temperature, p.top_p, p.min_p, p.top_k
        self.seed[row], self.want_logprobs[row] = req.seed & 0xFFFFFFFF, p.logprobs is not None
        self.penalized[row] = p.uses_penalties
        self.repetition[row], self.frequency[row], self.presence[row] = (p.repetition_penalty, p.frequency_penalty,
                                                                         p.presence_penalty)
        self.has_rule[row] = (p.structured_outputs is not None or p.allowed_token_ids is not None
                              or p.bad_words is not None)
        self.min_tokens[row] = p.min_tokens
        self.scored[row] = p.prompt_logprobs is not None

    def _take(self, batch: list[Request]) -> int:
        """A free row; when none is left, the rows of requests outside `batch` (finished,
        preempted or in another rank's step: rewritten if seen again) are freed first."""
        if not self._free:
            keep = set(batch)
            for req in [r for r in self._row_of if r not in keep]:
                self._free.append(self._row_of.pop(req)[0])
        if not self._free:
            raise RuntimeError(f"a step of {len(batch)} sequences needs more request rows than "
                               f"{self.table.shape[0]}")
        return self._free.pop()
