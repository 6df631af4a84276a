"""Multi-LoRA serving: adapters named per request (LoRARequest), kept in device slots by the
LoRAManager, applied per token inside the one compiled step (models.lora)."""
from pagedjax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
