"""PoolingParams (what one embedding request asks for) and the checkpoint's pooling type."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# last: the hidden state of the prompt's last token (after the final norm); mean: the mean of
# every prompt token's hidden state
POOLING_TYPES = ("last", "mean")
_ST_POOLING = "sentence_transformers.models.Pooling"
# sentence-transformers' Pooling config keys of the pooling types served here
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How to pool one prompt into its embedding.

    normalize: L2-normalize the embedding (after truncating it to `dimensions`).
    dimensions: keep the first `dimensions` values only (Matryoshka embeddings), in
    [1, the model's hidden size]; None: all of them.
    pooling_type: "last" or "mean"; None: the engine's (its `pooling_type` option, else the
    checkpoint's sentence-transformers pooling config, else "last")."""

    normalize: bool = True
    dimensions: int | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer (at most the model's hidden size), "
                             f"got {self.dimensions!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES} or None, got {self.pooling_type!r}")

    def check(self, hidden_size: int) -> None:
        """ValueError if `dimensions` exceeds the model's hidden size."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), "
                             f"got {self.dimensions}")


def checkpoint_pooling_type(model_dir: str | Path | None) -> str | None:
    """The pooling type a sentence-transformers checkpoint declares (modules.json names its
    Pooling module's folder, usually 1_Pooling, whose config.json sets the pooling mode): "last"
    or "mean"; None when it declares none (not a sentence-transformers checkpoint). A pooling
    mode served nowhere here (cls, max, ...) is a ValueError that says how to override it."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    folder = None
    modules = root / "modules.json"
    if modules.is_file():
        entries = json.loads(modules.read_text())
        folder = next((m.get("path") for m in entries if m.get("type") == _ST_POOLING), None)
    elif (root / "1_Pooling" / "config.json").is_file():
        folder = "1_Pooling"
    if folder is None or not (root / folder / "config.json").is_file():
        return None
    config = json.loads((root / folder / "config.json").read_text())
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if len(chosen) == 1:
        return chosen[0]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
    raise ValueError(f"the checkpoint's sentence-transformers pooling ({', '.join(others) or 'none'}) is not "
                     f"one pagedjax serves ({', '.join(POOLING_TYPES)}); pass pooling_type='last' or 'mean'")


def resolve_pooling_type(option: str | None, model_dir: str | Path | None) -> str:
    """The engine's pooling type: the `pooling_type` option when given, else the checkpoint's
    sentence-transformers config, else "last" (decoder embedding models pool the last token)."""
    if option is not None:
        return option
    found = checkpoint_pooling_type(model_dir)
    if found is None:
        logger.info("no sentence-transformers pooling config in %s: embeddings pool the last token", model_dir)
        return "last"
    return found
