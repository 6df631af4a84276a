"""Save and load a flat dict of numpy arrays as an orbax checkpoint, with a completion marker.

A cache directory counts as complete only once `mark_complete` has written its marker file,
which callers do last, after everything else in the directory is written; a directory without
the marker (an interrupted conversion) is treated as absent and rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

__all__ = ["save_tensors", "load_tensors", "is_complete", "mark_complete", "read_marker", "MARKER"]

MARKER = ".pagedjax_complete"


def save_tensors(directory: str | os.PathLike, tensors: dict[str, np.ndarray]) -> Path:
    """Write `tensors` (name -> array) as an orbax checkpoint at `directory` (replaced if present)."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute()
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = {str(name): np.asarray(array) for name, array in tensors.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)  # orbax writes to a temp dir and renames it when done
    return path


def load_tensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read an orbax checkpoint written by `save_tensors` back as name -> numpy array."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no orbax checkpoint at {path}")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path)
    return {name: np.asarray(array) for name, array in tree.items()}


def mark_complete(directory: str | os.PathLike, **info) -> None:
    """Write the completion marker into `directory` (call this last); `info` is stored as JSON."""
    marker = Path(directory) / MARKER
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"created": time.time(), **info}, indent=1))
    os.replace(tmp, marker)


def read_marker(directory: str | os.PathLike) -> dict | None:
    """The info stored by `mark_complete`, or None when the marker is missing or unreadable."""
    try:
        return json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: str | os.PathLike, **expected) -> bool:
    """True when `directory` holds the completion marker and its info matches `expected`
    (e.g. `is_complete(d, format=2)` treats a cache of an older format as incomplete)."""
    info = read_marker(directory)
    return info is not None and all(info.get(key) == value for key, value in expected.items())
