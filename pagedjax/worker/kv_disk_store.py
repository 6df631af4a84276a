"""The disk KV tier: full prefix blocks as files keyed by their hash, written in the background.

`put` copies the block into a buffer and queues it for one writer thread (a bounded queue: when
it is full the write is dropped and counted, the caller never waits for I/O). The writer
checksums, writes a temp file in the namespace folder, optionally fsyncs, and renames it into
place (atomic: a reader sees the whole file or none). Blocks still queued are served from
memory. `get` reads and verifies a file (`kv_disk_format`): a corrupt or truncated file is
counted, deleted and reported as a miss; `read_run` reads a prompt's run of blocks on a few
reader threads at once. An in-memory index (key -> size, least recently used
first) is rebuilt from the folder at start (file mtimes, refreshed on each hit, keep the order
across restarts) and bounds the folder to `max_bytes`, evicting the oldest files.

Thread-safe: one lock guards the index, the pending writes and the counters.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pagedjax.worker import kv_disk_format as fmt
from pagedjax.worker.kv_block_spec import BlockKey, BlockSpec, SpecInput, check_key

log = logging.getLogger(__name__)

FORMAT_VERSION = fmt.FORMAT_VERSION
_READ_CHUNK = 4  # read_run: blocks a reader thread takes at least (fewer: the caller reads them)
_STALE_TEMP_SECONDS = 60.0  # a temp file this old is a crashed writer's (younger: maybe another process's)
_COUNTERS = ("blocks_written", "blocks_read", "hits", "misses", "corrupt", "dropped_writes", "write_errors",
             "evicted", "bytes_written", "bytes_read", "write_seconds", "read_seconds")


class DiskKVStore:
    """Blocks of `block_spec` under `directory/<namespace of key_fields + spec + FORMAT_VERSION>/`,
    at most `max_bytes` of block files per namespace."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, key_fields: Mapping,
                 block_spec: SpecInput | BlockSpec, *, max_pending_writes: int = 64, fsync: bool = False,
                 read_threads: int | None = None):
        self.spec = BlockSpec(block_spec)
        if not isinstance(max_pending_writes, int) or max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be an int >= 1, got {max_pending_writes!r}")
        one_file = fmt.file_size(b"\0" * 32, self.spec)
        if not isinstance(max_bytes, (int, np.integer)) or isinstance(max_bytes, bool) or max_bytes < one_file:
            raise ValueError(f"kv disk store max_bytes={max_bytes!r} holds no block: one block file takes "
                             f"{one_file} bytes ({self.spec})")
        self.max_bytes = int(max_bytes)
        self.namespace = fmt.namespace_id(key_fields, self.spec)
        self.path = Path(directory) / self.namespace
        self.path.mkdir(parents=True, exist_ok=True)
        info = self.path / "namespace.json"
        if not info.exists():
            info.write_text(fmt.namespace_text(key_fields, self.spec) + "\n")
        self.fsync = bool(fsync)
        self.read_threads = min(4, os.cpu_count() or 1) if read_threads is None else read_threads
        if not isinstance(self.read_threads, int) or isinstance(self.read_threads, bool) or self.read_threads < 1:
            raise ValueError(f"read_threads must be an int >= 1, got {read_threads!r}")
        self._reader_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._pending: dict[BlockKey, np.ndarray] = {}  # queued for the writer: key -> payload
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._rebuild_index()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending_writes)
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name=f"kv-disk-writer-{self.namespace[:8]}", daemon=True)
        self._thread.start()

    # -- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __contains__(self, key) -> bool:
        return self.contains(key)

    def contains(self, key) -> bool:
        """True if the block is on disk or queued for it (the file is not read)."""
        key = check_key(key)
        with self._lock:
            return key in self._index or key in self._pending

    @property
    def num_bytes(self) -> int:
        """Bytes of the block files in the index."""
        with self._lock:
            return self._bytes

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {f"disk_kv_{name}": value for name, value in self._counts.items()}
            out.update(disk_kv_blocks=len(self._index), disk_kv_bytes=self._bytes,
                       disk_kv_pending_writes=len(self._pending))
        return out

    # -- writes -----------------------------------------------------------------------------
    def put(self, key, arrays: Mapping[str, np.ndarray]) -> bool:
        """Queues one block for writing (copied now; the caller may reuse its arrays). False if
        it is already stored or queued, or the queue is full (the write dropped and counted)."""
        key = check_key(key)
        arrays = self.spec.check(arrays)
        with self._lock:
            self._check_open()
            if key in self._index or key in self._pending:
                return False
        return self._enqueue(key, fmt.pack_payload(self.spec, arrays))

    def put_many(self, keys: Sequence, stacked: Mapping[str, np.ndarray]) -> int:
        """Queues n blocks from arrays stacked [n, ...]; returns how many were queued."""
        keys = [check_key(k) for k in keys]
        stacked = self.spec.check(stacked, batch=len(keys))
        queued = 0
        for i, key in enumerate(keys):
            with self._lock:
                self._check_open()
                if key in self._index or key in self._pending:
                    continue
            queued += self._enqueue(key, fmt.pack_payload(self.spec, {n: a[i] for n, a in stacked.items()}))
        return queued

    def _enqueue(self, key: BlockKey, payload: np.ndarray) -> bool:
        with self._lock:
            self._check_open()
            if key in self._index or key in self._pending:
                return False
            try:
                self._queue.put_nowait((key, payload))
            except queue.Full:
                self._counts["dropped_writes"] += 1
                return False
            self._pending[key] = payload
        return True

    def flush(self) -> None:
        """Waits until every queued write is on disk (or failed and counted)."""
        self._queue.join()

    def close(self) -> None:
        """Flushes and stops the writer thread; idempotent. Reads still work afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)  # after every queued write (the queue is FIFO)
        self._thread.join()
        with self._lock:
            readers, self._reader_pool = self._reader_pool, None
        if readers is not None:
            readers.shutdown(wait=True)

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DiskKVStore is closed; no more writes")

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # never let the thread die: later writes and flush() depend on it
                log.exception("kv disk store: writing a block failed")
            finally:
                self._queue.task_done()

    def _write(self, key: BlockKey, payload: np.ndarray) -> None:
        t0 = time.perf_counter()
        final = self.path / (fmt.file_stem(key) + fmt.SUFFIX)
        tmp = self.path / f".tmp-{uuid.uuid4().hex}{fmt.SUFFIX}"
        try:
            parts = fmt.encode_parts(key, self.spec, payload)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending.pop(key, None)
                self._counts["write_errors"] += 1
            log.warning("kv disk store: cannot write %s: %s", final, e)
            return
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        with self._lock:
            self._pending.pop(key, None)
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
            self._counts["blocks_written"] += 1
            self._counts["bytes_written"] += size
            self._evict_locked()
            self._counts["write_seconds"] += time.perf_counter() - t0

    def _evict_locked(self) -> None:
        while self._bytes > self.max_bytes and len(self._index) > 1:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._counts["evicted"] += 1
            (self.path / (fmt.file_stem(key) + fmt.SUFFIX)).unlink(missing_ok=True)

    # -- reads ------------------------------------------------------------------------------
    def get(self, key) -> dict[str, np.ndarray] | None:
        """The block's arrays (read-only) or None: not stored, or its file was corrupt (then
        deleted and counted). A hit becomes most recently used (its file's mtime too)."""
        t0 = time.perf_counter()
        arrays = self._read(check_key(key))
        with self._lock:
            self._counts["read_seconds"] += time.perf_counter() - t0
        return arrays

    def read_run(self, keys: Sequence) -> list[dict[str, np.ndarray]]:
        """The leading keys' blocks, up to the first that is not stored or fails to read: the
        leading keys stored (on disk or queued) are read and verified on `read_threads`
        threads at once (file reads and the checksum release the GIL), then cut at the first
        failure. read_seconds counts this call's wall time once."""
        keys = [check_key(k) for k in keys]
        t0 = time.perf_counter()
        with self._lock:
            run = next((i for i, k in enumerate(keys) if k not in self._index and k not in self._pending), len(keys))
            self._counts["misses"] += run < len(keys)
        keys = keys[:run]
        readers = self._readers() if self.read_threads > 1 and len(keys) >= 2 * _READ_CHUNK else None
        if readers is None:
            blocks = [self._read(k) for k in keys]
        else:  # a contiguous share of the run per thread: few hand-offs (each costs ~a block's read)
            n = min(self.read_threads, len(keys) // _READ_CHUNK)
            shares = [keys[len(keys) * i // n:len(keys) * (i + 1) // n] for i in range(n)]
            try:
                blocks = [b for share in readers.map(lambda ks: [self._read(k) for k in ks], shares) for b in share]
            except RuntimeError:  # closed by another thread meanwhile: read here
                blocks = [self._read(k) for k in keys]
        with self._lock:
            self._counts["read_seconds"] += time.perf_counter() - t0
        end = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
        return blocks[:end]

    def _readers(self) -> ThreadPoolExecutor | None:
        """The reader threads (made at the first parallel read); None once closed."""
        with self._lock:
            if self._reader_pool is None and not self._closed:
                self._reader_pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="kv-disk-reader")
            return self._reader_pool

    def _read(self, key: BlockKey) -> dict[str, np.ndarray] | None:
        with self._lock:
            payload = self._pending.get(key)
            if payload is not None:
                self._counts["hits"] += 1
                return fmt.unpack_payload(self.spec, payload.copy())
            if key not in self._index:
                self._counts["misses"] += 1
                return None
            self._index.move_to_end(key)
        path = self.path / (fmt.file_stem(key) + fmt.SUFFIX)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:  # evicted meanwhile, deleted by hand, unreadable: a miss
            with self._lock:
                self._drop_locked(key)
                self._counts["misses"] += 1
            if not isinstance(e, FileNotFoundError):
                log.warning("kv disk store: cannot read %s: %s", path, e)
            return None
        arrays = fmt.decode(key, self.spec, data)
        with self._lock:
            if arrays is None:
                self._counts["corrupt"] += 1
                self._counts["misses"] += 1
                self._drop_locked(key)
                path.unlink(missing_ok=True)  # under the lock: no rewrite of this key can race it
            else:
                self._counts["hits"] += 1
                self._counts["blocks_read"] += 1
                self._counts["bytes_read"] += len(data)
        if arrays is None:
            log.warning("kv disk store: corrupt block file %s removed", path)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the order is only a hint
        return arrays

    def _drop_locked(self, key: BlockKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    # -- start ------------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        """Indexes the folder's block files oldest first (by mtime); removes stale temp files
        and, if the folder is over max_bytes (a smaller bound than last time), the oldest files."""
        now = time.time()
        entries = []
        with os.scandir(self.path) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > _STALE_TEMP_SECONDS:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                key = fmt.key_of_file(entry.name)
                if key is not None and entry.is_file():
                    entries.append((st.st_mtime_ns, entry.name, key, st.st_size))
        entries.sort()
        for _, _, key, size in entries:
            self._index[key] = size
            self._bytes += size
        self._evict_locked()
