"""Counts XLA backend compilations in this process (JAX's own compile event)."""
from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def num_compilations() -> int:
    """XLA compilations seen since `install()` (all of them, in every thread)."""
    return _count


def enable_persistent_cache() -> None:
    """Keeps compiled steps on disk so a restart does not compile again, as the platform's
    policy says (pagedjax.platforms: Platform.compile_cache_dir, compile_cache_min_secs).

    Uses `$PAGEDJAX_CACHE/jax_compilation_cache` (default ~/.cache/pagedjax) unless the user
    configured a cache dir (JAX_COMPILATION_CACHE_DIR); `PAGEDJAX_COMPILE_CACHE=0` turns it off.
    Every executable is kept, however quick its compile (JAX keeps only those over 1 s by
    default; a warm start would compile the step's sampler and small helpers again), unless
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
    """
    import os

    from pagedjax.platforms import current_platform

    platform = current_platform()
    cache_dir = platform.compile_cache_dir()
    if cache_dir is None:
        return
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", platform.compile_cache_min_secs)
