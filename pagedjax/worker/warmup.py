"""BackgroundWarmup: compiles a runner's step shapes on a thread while serving starts.

The thread runs an ordered job list (ModelRunner._warmup_jobs), one job at a time, and only
while the engine lets it (`allow`): on a few cores a compile slows every step beside it, so
the engine holds it while requests run in shapes already compiled. `wait` finishes it.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

logger = logging.getLogger(__name__)

_running: "weakref.WeakSet[BackgroundWarmup]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Never let the interpreter exit while XLA compiles on a warm-up thread (it aborts)."""
    for warmup in list(_running):
        warmup.stop()


class BackgroundWarmup:
    def __init__(self):
        self.thread: threading.Thread | None = None
        self.go = threading.Event()  # set: the thread may start its next job
        self.go.set()
        self._stop = threading.Event()
        self._forced = False  # wait() asked it to finish: allow(False) is ignored
        self.error: BaseException | None = None

    def start(self, jobs: list[tuple]) -> None:
        """Runs each (job, T) as job(T) on a thread, waiting for `go` before each."""
        def run():
            start = time.monotonic()
            try:
                for job, t in jobs:
                    self.go.wait()
                    if self._stop.is_set():
                        return
                    job(t)
            except BaseException as e:  # surfaced by wait() and the engine's stats
                self.error = e
                logger.error("the background warm-up failed: %s (shapes not compiled yet compile on first use)", e)
                return
            logger.info("warm-up done: every step shape compiled (%d in the background, %.1f s)", len(jobs),
                        time.monotonic() - start)

        self.thread = threading.Thread(target=run, name="pagedjax-warmup", daemon=True)
        self.thread.start()
        _running.add(self)

    def allow(self, allowed: bool) -> None:
        """Lets the thread start its next job (True) or holds it before the next one (False);
        ignored once `wait` asked it to finish."""
        if allowed or self._forced:
            self.go.set()
        else:
            self.go.clear()

    def stop(self) -> None:
        """Stops after the job running now (waits for that one)."""
        self._stop.set()
        self.go.set()
        if self.thread is not None:
            self.thread.join()

    def wait(self) -> None:
        """Blocks until every job ran; re-raises the error of one that failed."""
        self._forced = True
        self.go.set()
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError("compiling the step buckets failed") from self.error

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()
