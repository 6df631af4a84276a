"""Where a model comes from: a local directory, the embedded default model, or a Hugging Face
model id (`org/name`) found in the local Hugging Face cache and downloaded into it where the
network allows. `resolve_model_dir` is the one place a model argument becomes a directory.

The cache is Hugging Face's own (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`), read when a model is resolved; `HF_HUB_OFFLINE=1` never touches
the network. A cached snapshot is used as it is (no update check), as `local_files_only`.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# what a download fetches: configs, safetensors weights, tokenizer files, chat templates
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = {"1", "on", "yes", "true"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")  # HF's rule: `name` or `org/name`


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment says now: $HF_HUB_CACHE (or its old name
    $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set: the cache only, no network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def is_repo_id(model: str) -> bool:
    """A Hugging Face model id (`org/name` or `name`) rather than a path: no leading `.`, `/`
    or `~`, no `..`, at most one `/`."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith((".", "-"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A model argument as a directory: None -> the embedded default model (converted and
    cached on first use); an existing directory -> itself; a Hugging Face id -> its snapshot
    in the Hugging Face cache (downloaded first where the network allows). FileNotFoundError
    saying where it looked and what to do otherwise."""
    if model is None:
        from pagedjax.models.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if isinstance(model, str) and is_repo_id(model) and not path.exists():
        return _from_hub(model)
    raise FileNotFoundError(f"model directory {str(path)!r} does not exist (pass a local Hugging Face model dir or a "
                            "Hugging Face model id such as HuggingFaceTB/SmolLM2-135M-Instruct; leave the model out "
                            "for the embedded default model)")


def _has_weights(snapshot: Path) -> bool:
    """A snapshot the loader can serve: a config and safetensors weights (an earlier
    tokenizer-only download leaves a snapshot without them)."""
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache entry without a snapshot
        snapshot = None
    if snapshot is not None and _has_weights(snapshot):
        return snapshot
    if hub_offline():
        what = "has no snapshot of it" if snapshot is None else \
            f"has a snapshot of it without weights ({snapshot}: no config.json + *.safetensors, e.g. a tokenizer only)"
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory, and the Hugging Face cache at {cache} {what} "
            "(HF_HUB_OFFLINE is set, so it was not downloaded). Download it where the network allows "
            f"(`hf download {repo_id}`, into this cache or one that HF_HUB_CACHE / HF_HOME then names), unset "
            "HF_HUB_OFFLINE, or pass a local model directory.")
    logger.warning("downloading %s from the Hugging Face Hub into %s", repo_id, cache)
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as exc:  # no network, no such repo, gated, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory, the Hugging Face cache at {cache} has no snapshot of it, "
            f"and downloading it failed ({type(exc).__name__}: {reason}). Check the id (and HF_TOKEN for a gated "
            f"model), download it where the network allows (`hf download {repo_id}`, into this cache or one that "
            "HF_HUB_CACHE / HF_HOME then names), or pass a local model directory.") from None
