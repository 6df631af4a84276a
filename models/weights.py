"""Read a model directory's weights as a flat dict of numpy arrays under Hugging Face names.

Supported layouts, tried in this order:

- `model.safetensors.index.json` plus the shards its `weight_map` names,
- one or more `*.safetensors` files (all of them are read),
- `weights_orbax/`: the orbax checkpoint written by `models.orbax_cache.save_tensors`
  (what `models.default_model.default_model_dir` produces).

bfloat16 safetensors load as `ml_dtypes.bfloat16` arrays (importing ml_dtypes teaches numpy
the dtype); pass `dtype=np.float32` to get float32 instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["load_tensors_from_dir", "ORBAX_SUBDIR", "SAFETENSORS_INDEX"]

ORBAX_SUBDIR = "weights_orbax"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, else every `*.safetensors`."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def _load_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, so safetensors can map them)
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def load_tensors_from_dir(model_dir: str | os.PathLike, dtype=None) -> dict[str, np.ndarray]:
    """All weights of `model_dir` as name -> numpy array (cast to `dtype` when given).

    Raises FileNotFoundError, naming the files looked for, when the directory has no weights.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    files = _safetensors_files(model_dir)
    if files:
        tensors = _load_safetensors(files)
    elif (model_dir / ORBAX_SUBDIR).is_dir():
        from .orbax_cache import load_tensors

        tensors = load_tensors(model_dir / ORBAX_SUBDIR)
    else:
        raise FileNotFoundError(
            f"no weights found in {model_dir}: expected model.safetensors, "
            f"{SAFETENSORS_INDEX} with its shards, or an orbax checkpoint in {ORBAX_SUBDIR}/"
        )
    if dtype is not None:
        tensors = {name: array.astype(dtype, copy=False) for name, array in tensors.items()}
    return tensors
