"""Random tiny Hugging Face checkpoints of each supported family, made with transformers."""
from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=512, initializer_range=0.2, bos_token_id=0, eos_token_id=1)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)),
}


WINDOW = 16  # the sliding window of the tiny Gemma / Mixtral models: test prompts run past it

# families beyond the Llama family (their own tests: tests/models/test_families.py)
MORE_FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=10.0, pad_token_id=0, tie_word_embeddings=False)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         sliding_window=WINDOW, query_pre_attn_scalar=16, pad_token_id=0, tie_word_embeddings=False,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                       tie_word_embeddings=False)),
}


def make_checkpoint(family: str, path: Path, seed: int = 0):
    """Saves a random tiny checkpoint of `family` into `path`; returns the torch model."""
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES.get(family) or MORE_FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    # the oracle in eager attention: transformers 5.12 (what installs beside google-tunix) runs
    # Gemma 2 through SDPA, which drops its attention soft-capping (later releases refuse SDPA)
    model = getattr(transformers, model_cls)._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # biases default to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate for one prompt, EOS ignored."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


TOKENIZER_CORPUS = [
    '{"name": "Alice", "age": 31, "tags": ["admin", "user"], "active": true, "score": -2.5e3}',
    '[{"id": 1, "value": null}, {"id": 22, "value": false}]',
    "The quick brown fox jumps over the lazy dog. Hello, world! 0123456789",
    "def main():\n    return [x * 2 for x in range(10)]  # café naïve über",
]


def make_tokenizer(vocab_size: int = 384, bos: str = "<s>", eos: str = "</s>"):
    """A byte-level BPE transformers tokenizer trained in memory (no download): ids 0 and 1 are
    `bos` and `eos` (as COMMON says), then all 256 bytes, so every string is representable,
    then merges up to `vocab_size` tokens at most."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
