"""The engine's LoRA adapter registry and introspection (counts, costs, stats): a part of
LLMEngine (a mixin), kept apart by concern."""
from __future__ import annotations

from pagedjax.engine import engine_stats


class EngineInfo:
    def add_lora(self, lora_request) -> None:
        """Registers and reads a LoRA adapter ahead of its first request (ValueError if it
        cannot serve: bad files, rank above max_lora_rank, shapes of another model, id taken)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter (running requests finish with it); False if it was not known."""
        if self.lora is None or lora_int_id not in self.lora.known:
            return False
        self.lora.remove(lora_int_id)
        return True

    def list_loras(self) -> list:
        """The LoRARequests of every known adapter, by id."""
        return [] if self.lora is None else [self.lora.known[i] for i in sorted(self.lora.known)]

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens + (self.beams.num_generated_tokens if self.beams else 0)

    @property
    def drafter(self):
        """The draft model's proposer (speculative decoding with a draft model), else None."""
        return self.spec.drafter if self.spec is not None else None

    @property
    def num_verify_steps(self) -> int:
        return self.spec.num_verify_steps if self.spec is not None else 0

    def step_costs(self) -> dict[int, float]:
        """Wall seconds of a step by its size T, as measured so far (medians of recent steps;
        kept with speculative decoding, whose draft allocation weighs them)."""
        return self.spec.step_costs.as_dict() if self.spec is not None else {}

    def draft_costs(self) -> dict[int, float]:
        """Wall seconds of a draft model's proposal by its depth (drafts per request), as
        measured so far (medians of recent proposals)."""
        return self.spec.draft_costs.as_dict() if self.spec is not None else {}

    def stats(self) -> dict:
        """Totals over the data-parallel ranks; "data_parallel_ranks" has each rank's own."""
        return engine_stats.stats(self)

    def compile_stats(self) -> dict:
        """The compile counts and warm-up state of stats(), cheap and safe from any thread."""
        return engine_stats.compile_stats(self)

    def kv_memory(self):
        """KV memory accounting (core.kv_memory) summed over the data-parallel ranks."""
        return engine_stats.kv_memory(self)
