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
