"""LoRAManager: which adapters are known, read into host memory, and held in device slots.

Three tiers:
- known adapters (LoRARequest by id): what requests and the server may name;
- host copies (LRU, `max_cpu_loras`): read from disk by `add` (at add_request, add_lora or
  server start), read again there if evicted. A request holds its adapter's host copy
  itself (`Request.lora_adapter`) until it ends, so nothing on the scheduling path reads
  a file, and unloading or re-registering an id never changes what a queued request runs;
- device slots 1..max_loras (slot 0 is the base model), keyed by the adapter's content
  (its fingerprint): a request is admitted only once its adapter holds a slot (`admit`, the
  scheduler's gate). A slot is taken from no running request while any uses it; a free slot
  goes empty first, else least recently used. The writes of newly filled slots run before
  the next step (`flush`).

Only host bookkeeping here; the device stacks and their writes are the runner's
(models.lora, ModelRunner.load_lora_slot).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from pagedjax.models.lora import LoRAAdapter, load_peft_adapter, slot_arrays
from pagedjax.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model_config, layout, max_loras: int, max_lora_rank: int, max_cpu_loras: int, schedulers,
                 targets: tuple[str, ...]):
        self.model_config, self.layout, self.targets = model_config, layout, tuple(targets)
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.schedulers = schedulers  # every data rank's: the running requests pin their slots
        self.known: dict[int, LoRARequest] = {}  # lora_int_id -> its request (name, path)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: last = most recently used
        self.slot_keys: list[str | None] = [None] * max_loras  # device slot s + 1 holds the adapter of this fingerprint
        self._last_use = [0] * max_loras
        self._clock = itertools.count(1)
        self._pending: list[tuple[int, LoRAAdapter]] = []  # (slot, adapter) to write before the next step
        self.num_slot_loads = 0  # adapters written into a device slot
        self.num_disk_loads = 0  # adapters read from disk

    # -- adapters ---------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """Registers an adapter and reads it (if not in host memory): ValueError if it cannot
        serve (bad files, rank, shapes) or its id already names another adapter."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        old = self.known.get(lora.lora_int_id)
        if old is not None and old != lora:
            raise ValueError(f"lora_int_id {lora.lora_int_id} already names adapter {old.lora_name!r} "
                             f"({old.lora_path}); give each adapter its own id")
        adapter = self._host_copy(lora)
        self.known[lora.lora_int_id] = lora
        return adapter

    def remove(self, lora_int_id: int) -> LoRARequest:
        """Forgets an adapter (KeyError if unknown): new requests cannot name it; queued and
        running ones finish with it (they hold its host copy); its device slot is reused once
        no running request needs it."""
        lora = self.known.pop(lora_int_id)
        self._host.pop(lora_int_id, None)
        return lora

    def _host_copy(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_peft_adapter(lora.lora_path, self.model_config, self.max_lora_rank, self.targets)
            self.num_disk_loads += 1
            self._host[lora.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_int_id)
        return adapter

    # -- device slots -----------------------------------------------------------------------
    def admit(self, req) -> bool:
        """The scheduler's gate: True when req may run now, with `req.lora_slot` set (0: no
        adapter); False while every slot is held by other adapters' running requests."""
        adapter = req.lora_adapter
        if adapter is None:
            req.lora_slot = 0
            return True
        if adapter.fingerprint in self.slot_keys:
            s = self.slot_keys.index(adapter.fingerprint)
        else:
            busy = {r.lora_slot for sched in self.schedulers for r in sched.running if r.lora_adapter is not None}
            free = [s for s in range(self.max_loras) if s + 1 not in busy]
            if not free:
                return False
            s = min(free, key=lambda i: (self.slot_keys[i] is not None, self._last_use[i]))  # empty, else LRU
            self.slot_keys[s] = adapter.fingerprint
            self._pending.append((s + 1, adapter))
        self._last_use[s] = next(self._clock)
        req.lora_slot = s + 1
        return True

    def flush(self, load_slot) -> None:
        """Writes the slots filled since the last step: load_slot(slot, arrays) per slot
        (the runner's; arrays: models.lora.slot_arrays)."""
        for slot, adapter in self._pending:
            load_slot(slot, slot_arrays(adapter, self.model_config, self.layout, self.max_lora_rank, self.targets))
            self.num_slot_loads += 1
        self._pending = []

    def stats(self) -> dict:
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "lora_adapters_known": len(self.known), "lora_adapters_in_host_memory": len(self._host),
                "lora_slots_used": sum(k is not None for k in self.slot_keys),
                "lora_slot_loads": self.num_slot_loads, "lora_disk_loads": self.num_disk_loads}
