"""Random PEFT LoRA adapters for test checkpoints, and transformers + peft as the oracle."""
from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: Path, out_dir: Path, rank: int, alpha: float | None = None,
                 targets=ALL_TARGETS, seed: int = 0, std: float = 0.05, **lora_config) -> Path:
    """Saves a LoRA adapter of `rank` for the checkpoint in base_dir, with random A and B
    (normal, `std`; PEFT's own init leaves B zero: no effect to test) into out_dir."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                                            target_modules=list(targets), lora_dropout=0.0, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * std)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model of base_dir with the adapter applied (None: the base model), eval."""
    import torch
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32).eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir)).eval()
