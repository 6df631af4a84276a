"""Sampling defaults from a checkpoint's `generation_config.json`, as vLLM's `--generation-config`.

`auto` reads the model directory's file, `vllm` reads none (the engine's own defaults), any
other value is a folder holding a generation_config.json. Of the file, only the sampling
fields apply (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
max_tokens), each where it is present and not null; they are the defaults of a request that
leaves the field unset (the server's requests, `LLM.get_default_sampling_params()`, the
`pagedjax generate` flags not given).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: str, model_dir: Path | None) -> dict:
    """SamplingParams field -> default, read as `source` says (module docstring); {} when the
    file is missing (auto) or sets no sampling field. ValueError naming the file for a value
    SamplingParams refuses. Logs the overrides once (a warning, as vLLM).
    `source` is checked by EngineConfig."""
    if source == "vllm":
        return {}
    path = (Path(model_dir) if source == "auto" else Path(source).expanduser()) / FILE_NAME
    if source == "auto" and (model_dir is None or not path.is_file()):
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} (generation_config={source!r}): {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} (generation_config={source!r}) is not a JSON object")
    defaults = {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path} (generation_config={source!r}) has a sampling default the engine cannot use: {exc} "
                         "(generation_config='vllm' ignores the file)") from None
    if defaults:
        logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                       "config (%s): %s. Requests that set these fields use their own values; "
                       "generation_config='vllm' (--generation-config vllm) keeps the engine's defaults.",
                       path, defaults)
    return defaults
