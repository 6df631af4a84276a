"""Several processes (and hosts) running one engine, on JAX's multi-controller runtime.

Every process calls `initialize(...)` before anything touches JAX, then builds the same
`LLM` and calls `generate` with the same arguments: each process runs the same scheduler on
the same inputs, hence the same steps in the same order, and every process gets the same
outputs. The mesh spans every process's devices. Steps are compiled in the foreground under
several processes (a background warm-up would let the processes' step sizes drift apart).
`pagedjax serve` listens on process 0 only (`LeaderEngine`); the others `follow` it.
"""
from __future__ import annotations

import pickle

import jax
import numpy as np


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """jax.distributed.initialize, with gloo collectives on CPU (so two local processes can
    share one model on this machine)."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got "
                         f"{num_processes}, {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def to_host(x) -> np.ndarray:
    """The whole of a (possibly multi-process) array, as numpy on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# -- serving across processes: process 0 leads, the others follow its schedule -------------
def _broadcast(payload: bytes | None) -> bytes:
    """Process 0's bytes on every process (two collectives: the length, then the bytes)."""
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.array([len(payload or b"")], np.int64))[0])
    buf = np.frombuffer(payload, np.uint8) if payload else np.zeros(n, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))) if n else b""


class LeaderEngine:
    """Wraps process 0's LLMEngine for the server: the requests added and aborted since the
    last step are broadcast right before each step, so the followers (`follow`) apply the
    same calls in the same order and run the same step. Everything else passes through."""

    def __init__(self, engine):
        self.engine = engine
        self._calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def output_deltas(self) -> bool:  # set by AsyncEngine: must reach the wrapped engine
        return self.engine.output_deltas

    @output_deltas.setter
    def output_deltas(self, value: bool) -> None:
        self.engine.output_deltas = value

    def add_request(self, request_id, prompt, params=None, cache_salt=None) -> None:
        self.engine.add_request(request_id, prompt, params, cache_salt)  # raises before anything is logged
        self._calls.append(("add", request_id, prompt, params, cache_salt))

    def add_beam_search(self, request_id, prompt, params) -> None:
        self.engine.add_beam_search(request_id, prompt, params)
        self._calls.append(("add_beam", request_id, prompt, params))

    def add_embed_request(self, request_id, prompt, params=None) -> None:
        self.engine.add_embed_request(request_id, prompt, params)
        self._calls.append(("add_embed", request_id, prompt, params))

    def abort_request(self, request_id) -> None:
        self.engine.abort_request(request_id)
        self._calls.append(("abort", request_id))

    def step(self):
        calls, self._calls = self._calls, []
        _broadcast(pickle.dumps(calls))
        return self.engine.step()

    def idle_tick(self) -> None:
        """Called by the server every few seconds while idle: keeps the followers' pending
        collective from waiting without end."""
        _broadcast(pickle.dumps([("tick",)]))

    def close(self) -> None:
        """Tells the followers to exit (call once, after the server stopped)."""
        _broadcast(pickle.dumps([("exit",)]))


def follow(engine) -> None:
    """The loop of processes 1..N-1 under `pagedjax serve`: apply process 0's calls, run the
    same step, until process 0 says exit (or a collective fails because it is gone)."""
    while True:
        calls = pickle.loads(_broadcast(None))
        if calls == [("tick",)]:
            continue
        for call in calls:
            if call[0] == "exit":
                return
            if call[0] == "add":
                engine.add_request(*call[1:])
            elif call[0] == "add_beam":
                engine.add_beam_search(*call[1:])
            elif call[0] == "add_embed":
                engine.add_embed_request(*call[1:])
            else:
                engine.abort_request(call[1])
        engine.step()
        engine.finished_beam_searches.clear()  # only the leader answers
