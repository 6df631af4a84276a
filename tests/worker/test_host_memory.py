"""host_memory.prefault: the host KV tier's storage committed in the background, contents kept."""
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedjax.worker import host_memory
from pagedjax.worker.kv_host_pool import HostKVPool

MIB = 1 << 20


def _rss_bytes() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")
def test_prefault_commits_the_pages_and_keeps_what_was_written(monkeypatch):
    monkeypatch.setattr(host_memory, "CHUNK_BYTES", 4 * MIB)  # several chunks per array
    a, b = np.empty(24 * MIB, np.uint8), np.empty((6 * MIB,), np.float32)
    a[MIB:2 * MIB] = 7  # written before (whole pages inside the populated span): kept
    before = _rss_bytes()
    thread = host_memory.prefault([a, b])
    a[-2 * MIB:-MIB] = 9  # written meanwhile: kept (populating never changes contents)
    thread.join(60)
    assert not thread.is_alive()
    assert (a[MIB:2 * MIB] == 7).all() and (a[-2 * MIB:-MIB] == 9).all()
    # the pages are resident now (where the kernel has MADV_POPULATE_WRITE, 5.14+)
    assert _rss_bytes() - before > 40 * MIB or not _kernel_at_least(5, 14)


def test_prefault_skips_a_pool_larger_than_the_memory_available(monkeypatch, caplog):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 8 * MIB)
    assert host_memory.prefault([np.empty(16 * MIB, np.uint8)]) is None
    assert "not committed ahead" in caplog.text


def _kernel_at_least(major: int, minor: int) -> bool:
    import platform

    parts = platform.release().split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (major, minor)


def test_prefault_refuses_a_strided_view_and_the_pool_option():
    with pytest.raises(ValueError, match="C-contiguous"):
        host_memory.prefault([np.empty((64, 64), np.float32)[:, ::2]])
    assert host_memory.prefault([]) is None
    spec = {"k": ((2, 4, 8), np.float32)}
    assert HostKVPool(spec, MIB).prefault_thread is None  # off unless asked
    pool = HostKVPool(spec, MIB, prefault=True)
    if sys.platform.startswith("linux"):
        pool.prefault_thread.join(60)
        assert not pool.prefault_thread.is_alive()
