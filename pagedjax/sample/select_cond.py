"""`cond`: `jax.lax.cond` where skipping a branch is free, both branches and a select on GPUs.

XLA:GPU runs a conditional from the host: it copies the predicate to the host and waits
there for the device to reach it, so nothing after it (the rest of the sampler, the next
step) is queued while the device works, and the host's work for the next step no longer
overlaps the device's for this one. CPU and TPU branch where they run (the host drives
XLA:CPU anyway; a TPU decides on its scalar core), so skipping unused work is free there.
On GPUs both branches are computed and the result selected: the sampler's branches (filters,
draws, log-probabilities over [S, V]) cost microseconds there, a wait costs the overlap.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pagedjax.platforms import current_platform

_forced: bool | None = None  # tests: select (True) or branch (False) whatever the backend


def selects() -> bool:
    """Whether `cond` traced now computes both branches (read at trace time)."""
    return _forced if _forced is not None else current_platform().select_conditionals  # GPUs


def cond(pred, true_fn, false_fn):
    """`jax.lax.cond(pred, true_fn, false_fn)` (pred a scalar bool, the branches take no
    operands and return the same pytree), or `where(pred, true_fn(), false_fn())` on GPUs."""
    if selects():
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(), false_fn())
    return jax.lax.cond(pred, true_fn, false_fn)


@contextlib.contextmanager
def forced(select: bool):
    """Trace `cond` as a select (True) or a branch (False) on any backend, inside the block
    (for tests: functions must be traced afresh inside it, e.g. a new lambda under jit)."""
    global _forced
    before, _forced = _forced, select
    try:
        yield
    finally:
        _forced = before
