"""Read a Llama-architecture GGUF file into Hugging Face form, without torch.

`load_gguf(path)` returns a `GGUFCheckpoint` holding

- `config`: a `config.json`-style dict for a `LlamaForCausalLM`,
- `tensors`: float32 numpy arrays under Hugging Face names and shapes (`[out, in]`),
  dequantized with `gguf.quants.dequantize`, with llama.cpp's Q/K row permutation undone,
- `tokenizer`: a transformers fast tokenizer built from the GGUF `tokenizer.*` fields by
  transformers' GGUF tokenizer converter (which, unlike its GGUF model loader, imports no torch).

The `gguf` package reads the file; transformers is used only for the tokenizer.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFCheckpoint", "load_gguf", "read_gguf_config", "build_gguf_tokenizer"]

_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# GGUF per-layer tensor suffix -> Hugging Face per-layer name.
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclasses.dataclass
class GGUFCheckpoint:
    """A GGUF model converted to Hugging Face config, tensor names and tokenizer."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast


def _field(reader, key: str, default: Any = None) -> Any:
    """The Python value of metadata field `key` (str, number, bool or list), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def read_gguf_config(reader) -> dict[str, Any]:
    """A Hugging Face `config.json` dict from an open `gguf.GGUFReader`'s metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    head_dim = int(meta("attention.key_length", meta("rope.dimension_count", hidden // n_heads)))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    return config


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor `gguf_name` (e.g. `blk.3.attn_q.weight`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, suffix = gguf_name.split(".", 2)
    if prefix != "blk" or suffix not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head it stores the rotary pairs interleaved
    (rows 0,d/2,1,d/2+1,...); Hugging Face keeps the two rotary halves as separate blocks."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    """One `gguf.ReaderTensor` as a float32 array in Hugging Face shape (`[out, in]`)."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest axis first
    data = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def _read_tensors(reader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    """All tensors of the file, dequantized, renamed and un-permuted."""
    from tqdm.auto import tqdm

    tensors = {}
    for tensor in tqdm(reader.tensors, desc="dequantize GGUF", unit="tensor", disable=not progress,
                       file=sys.stderr, leave=False):
        name = _hf_name(tensor.name)
        w = _dequantize(tensor)
        if name.endswith("q_proj.weight"):
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rows(w, config["num_key_value_heads"])
        tensors[name] = w
    return tensors


def _transformers_gguf_tokenizer_api():
    """(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer) from whichever transformers module holds
    them: integrations.gguf.gguf_tokenizer_mapping in recent releases (5.25 has them there),
    integrations.ggml before (4.x to 5.17 at least)."""
    import importlib

    for module in ("transformers.integrations.gguf.gguf_tokenizer_mapping", "transformers.integrations.ggml"):
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(m, "GGUF_TOKENIZER_MAPPING") and hasattr(m, "convert_gguf_tokenizer"):
            return m.GGUF_TOKENIZER_MAPPING, m.convert_gguf_tokenizer
    import transformers

    raise ImportError(f"transformers {transformers.__version__} has no GGUF tokenizer converter "
                      "(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer) where pagedjax looks for it")


def build_gguf_tokenizer(reader):
    """A `PreTrainedTokenizerFast` from the GGUF `tokenizer.*` fields (bos/eos/unk/pad tokens,
    chat template and add_bos/add_eos flags included), via transformers' GGUF converter."""
    from transformers import PreTrainedTokenizerFast

    GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _transformers_gguf_tokenizer_api()
    groups = {
        group: {name: _field(reader, f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in reader.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # old sentencepiece files: llama.cpp adds BOS
        init_kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for special in ("bos", "eos", "unk", "pad"):
        token_id = tokenizer_dict.get(f"{special}_token_id")
        init_kwargs[f"{special}_token"] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer_dict)
    # the special tokens come from the file's ids: some transformers releases (5.17) also guess them
    # in `extra`, wrongly for ChatML files (eos '<|im_start|>')
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **init_kwargs})


def load_gguf(path: str | Path, progress: bool = False) -> GGUFCheckpoint:
    """Load a Llama-architecture GGUF file as HF config, float32 HF-named tensors and tokenizer."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = read_gguf_config(reader)
    tensors = _read_tensors(reader, config, progress)
    tokenizer = build_gguf_tokenizer(reader)
    return GGUFCheckpoint(config=config, tensors=tensors, tokenizer=tokenizer)
