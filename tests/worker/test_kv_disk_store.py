"""DiskKVStore: the disk KV tier (async atomic writes, checksummed files, LRU bound, restarts)."""
import os
import threading
import time

import numpy as np
import pytest
from kv_blocks import assert_block_equal, block_spec, key, random_block

from pagedjax.worker import kv_disk_format as fmt
from pagedjax.worker.kv_block_spec import BlockSpec
from pagedjax.worker.kv_disk_store import FORMAT_VERSION, DiskKVStore

FIELDS = {"model": "tiny-llama@abc123", "dtype": "bfloat16", "block_size": 4, "tp_rank": 0}
MB = 1 << 20


def _file_bytes(kind="f32"):
    return fmt.file_size(key(0), BlockSpec(block_spec(kind)))


def _gate(store):
    """Holds the writer thread before each write until `release` is set; `entered` is set
    when it is waiting."""
    entered, release = threading.Event(), threading.Event()
    write = store._write

    def gated(k, payload):
        entered.set()
        assert release.wait(10)
        write(k, payload)

    store._write = gated
    return entered, release


@pytest.mark.parametrize("kind", ["bf16", "f32", "int8"])
def test_round_trip_from_disk(tmp_path, kind):
    spec = block_spec(kind)
    rng = np.random.default_rng(0)
    blocks = [random_block(spec, rng) for _ in range(3)]
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        for i, b in enumerate(blocks):
            assert store.put(key(i), b)
        assert not store.put(key(0), blocks[1])  # stored or queued already: skipped
        store.flush()
        for i, b in enumerate(blocks):
            assert_block_equal(store.get(key(i)), b)
        assert store.get(key(7)) is None
        s = store.stats()
    counts = [s[f"disk_kv_{c}"] for c in ("blocks_written", "blocks_read", "hits", "misses")]
    assert counts == [3, 3, 3, 1]
    assert s["disk_kv_bytes_written"] == s["disk_kv_bytes_read"] == 3 * fmt.file_size(key(0), BlockSpec(spec))
    assert s["disk_kv_write_seconds"] > 0 and s["disk_kv_read_seconds"] > 0
    names = sorted(p.name for p in (tmp_path / store.namespace).iterdir())
    assert names == sorted([key(i).hex() + ".kvb" for i in range(3)] + ["namespace.json"])


def test_put_many_and_int_keys(tmp_path):
    spec = block_spec("int8")
    rng = np.random.default_rng(1)
    batch = random_block(spec, rng, batch=3)
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        assert store.put_many([5, 6, 5], batch) == 2
        store.flush()
        assert store.get(9) is None
        got = store.read_run([6, 5, 9])
    assert len(got) == 2
    for g, row in zip(got, [1, 0]):
        assert_block_equal(g, {n: batch[n][row] for n in spec})



@pytest.mark.parametrize("read_threads", [1, 3])
def test_read_run_stops_at_the_first_missing_or_corrupt_block(tmp_path, read_threads):
    spec = block_spec("bf16")
    rng = np.random.default_rng(5)
    blocks = [random_block(spec, rng) for _ in range(10)]  # 10: two threads' shares of a run
    store = DiskKVStore(tmp_path, 2 * MB, FIELDS, spec, read_threads=read_threads)
    for i, b in enumerate(blocks):
        store.put(key(i), b)
    store.flush()
    got = store.read_run([key(i) for i in range(10)])
    assert len(got) == 10
    for g, b in zip(got, blocks):
        assert_block_equal(g, b)
    assert len(store.read_run([key(0), key(1), key(42), key(3)])) == 2  # key 42 was never stored
    assert store.read_run([key(42), key(0)]) == [] and store.read_run([]) == []
    path = store.path / (key(2).hex() + ".kvb")
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # a flipped payload byte: the run ends before it, the file is removed
    path.write_bytes(bytes(data))
    got = store.read_run([key(i) for i in range(10)])
    assert len(got) == 2 and not path.exists() and store.stats()["disk_kv_corrupt"] == 1
    assert store.stats()["disk_kv_read_seconds"] > 0
    assert (store._reader_pool is not None) == (read_threads > 1)
    store.close()  # reads still work, on the calling thread
    assert len(store.read_run([key(i) for i in range(10)])) == 2 and store._reader_pool is None
    with pytest.raises(ValueError, match="read_threads"):
        DiskKVStore(tmp_path, MB, FIELDS, spec, read_threads=0)


def test_lru_eviction_order_and_bound(tmp_path):
    spec = block_spec("f32")
    rng = np.random.default_rng(2)
    blocks = {c: random_block(spec, rng) for c in "abcd"}
    with DiskKVStore(tmp_path, 3 * _file_bytes() + 10, FIELDS, spec) as store:
        for c in "abc":
            store.put(c.encode() * 32, blocks[c])
            store.flush()  # one at a time: a known order
        assert store.get(b"a" * 32) is not None  # order b, c, a
        store.put(b"d" * 32, blocks["d"])
        store.flush()
        assert not store.contains(b"b" * 32) and store.get(b"b" * 32) is None
        for c in "acd":
            assert_block_equal(store.get(c.encode() * 32), blocks[c])
        assert len(store) == 3 and store.num_bytes == 3 * _file_bytes() <= store.max_bytes
        assert store.stats()["disk_kv_evicted"] == 1
        files = [p for p in store.path.iterdir() if p.suffix == ".kvb"]
        assert len(files) == 3 and sum(p.stat().st_size for p in files) == store.num_bytes


def test_restart_finds_blocks_in_lru_order(tmp_path):
    spec = block_spec("bf16")
    rng = np.random.default_rng(3)
    blocks = [random_block(spec, rng) for _ in range(3)]
    with DiskKVStore(tmp_path, MB, dict(FIELDS), spec) as store:
        for i, b in enumerate(blocks):
            store.put(key(i), b)
    # close() flushed; a new store on the same folder and key finds every block
    with DiskKVStore(tmp_path, MB, dict(FIELDS), spec) as again:
        assert len(again) == 3
        for i, b in enumerate(blocks):
            assert_block_equal(again.get(key(i)), b)
        files = {i: again.path / (key(i).hex() + ".kvb") for i in range(3)}
        now = time.time()
        for i, age in ((0, 100), (1, 300), (2, 200)):  # least recently used: 1, then 2, then 0
            os.utime(files[i], (now - age, now - age))
        assert again.get(key(2)) is not None and files[2].stat().st_mtime > now - 50  # a hit refreshes mtime
    # restarting with room for two evicts the oldest at start
    with DiskKVStore(tmp_path, 2 * _file_bytes("bf16") + 10, dict(FIELDS), spec) as small:
        assert len(small) == 2 and not small.contains(key(1)) and not files[1].exists()
        assert small.contains(key(0)) and small.contains(key(2))


@pytest.mark.parametrize("change", [{"model": "other-model"}, {"dtype": "float32"}, {"block_size": 8}])
def test_other_key_fields_never_see_the_blocks(tmp_path, change):
    spec = block_spec("bf16")
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        store.put(key(0), random_block(spec, np.random.default_rng(4)))
    with DiskKVStore(tmp_path, MB, {**FIELDS, **change}, spec) as other:
        assert other.path != store.path and len(other) == 0 and other.get(key(0)) is None
    assert '"format_version": %d' % FORMAT_VERSION in (store.path / "namespace.json").read_text()


def test_another_block_spec_is_another_namespace(tmp_path):
    bf16, int8 = block_spec("bf16"), block_spec("int8")
    with DiskKVStore(tmp_path, MB, FIELDS, bf16) as a, DiskKVStore(tmp_path, MB, FIELDS, int8) as b:
        a.put(key(0), random_block(block_spec("bf16"), np.random.default_rng(5)))
        a.flush()
        assert a.path != b.path and b.get(key(0)) is None


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty"])
def test_corrupt_file_is_a_miss_and_removed(tmp_path, damage):
    spec = block_spec("f32")
    rng = np.random.default_rng(6)
    block = random_block(spec, rng)
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        store.put(key(0), block)
        store.flush()
        path = store.path / (key(0).hex() + ".kvb")
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "empty":
            data = b""
        else:
            data[len(data) // 2 if damage == "flip_payload" else 20] ^= 0x01
        path.write_bytes(bytes(data))
        assert store.get(key(0)) is None
        s = store.stats()
        assert (s["disk_kv_corrupt"], s["disk_kv_misses"], s["disk_kv_hits"]) == (1, 1, 0)
        assert not path.exists() and not store.contains(key(0)) and store.num_bytes == 0
        assert store.put(key(0), block)  # recomputed and written again
        store.flush()
        assert_block_equal(store.get(key(0)), block)


def test_a_file_under_another_key_name_is_rejected(tmp_path):
    spec = block_spec("f32")
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        store.put(key(0), random_block(spec, np.random.default_rng(7)))
        store.flush()
        os.replace(store.path / (key(0).hex() + ".kvb"), store.path / (key(1).hex() + ".kvb"))
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        assert store.contains(key(1)) and store.get(key(1)) is None and store.stats()["disk_kv_corrupt"] == 1


def test_full_queue_drops_writes_and_pending_blocks_are_served(tmp_path):
    spec = block_spec("f32")
    rng = np.random.default_rng(8)
    blocks = [random_block(spec, rng) for _ in range(4)]
    store = DiskKVStore(tmp_path, MB, FIELDS, spec, max_pending_writes=2)
    entered, release = _gate(store)
    assert store.put(key(0), blocks[0])
    assert entered.wait(10)  # the writer holds block 0; the queue has room for two more
    assert store.put(key(1), blocks[1]) and store.put(key(2), blocks[2])
    t0 = time.perf_counter()
    assert not store.put(key(3), blocks[3])  # full: dropped at once, never waited for
    assert time.perf_counter() - t0 < 1.0
    assert store.stats()["disk_kv_dropped_writes"] == 1 and store.stats()["disk_kv_pending_writes"] == 3
    blocks[2]["k"][...] = 0  # put copied the arrays; the caller may reuse them
    got = store.get(key(1))  # still queued: served from memory
    assert_block_equal(got, blocks[1])
    assert store.contains(key(2)) and not store.contains(key(3))
    release.set()
    store.close()
    assert store.stats()["disk_kv_blocks_written"] == 3 and not store.contains(key(3))
    assert store.get(key(2))["k"].any()


def test_close_waits_for_pending_writes_and_is_idempotent(tmp_path):
    spec = block_spec("int8")
    rng = np.random.default_rng(9)
    blocks = [random_block(spec, rng) for _ in range(5)]
    store = DiskKVStore(tmp_path, MB, FIELDS, spec, fsync=True)
    entered, release = _gate(store)
    for i, b in enumerate(blocks):
        assert store.put(key(i), b)
    assert entered.wait(10)
    threading.Timer(0.2, release.set).start()
    store.close()  # returns only after all five are on disk
    assert store.stats()["disk_kv_blocks_written"] == 5
    assert len([p for p in store.path.iterdir() if p.suffix == ".kvb"]) == 5
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(key(9), blocks[0])
    assert_block_equal(store.get(key(4)), blocks[4])  # reads still work


def test_concurrent_gets_during_writes(tmp_path):
    spec = block_spec("f32")
    rng = np.random.default_rng(10)
    n = 40
    blocks = [random_block(spec, rng) for _ in range(n)]
    store = DiskKVStore(tmp_path, 30 * _file_bytes(), FIELDS, spec, max_pending_writes=n)
    bad = []

    def reader():
        for _ in range(4):
            for i in range(n):
                got = store.get(key(i))  # a miss (not yet put, or evicted) or exactly the block
                if got is not None and any(got[m].tobytes() != blocks[i][m].tobytes() for m in spec):
                    bad.append(i)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    for i, b in enumerate(blocks):
        store.put(key(i), b)
    for t in readers:
        t.join()
    store.close()
    assert not bad
    s = store.stats()
    assert s["disk_kv_corrupt"] == 0 and s["disk_kv_blocks_written"] == n and len(store) == 30
    assert not [p for p in store.path.iterdir() if p.name.startswith(".tmp-")]  # every temp renamed


def test_stale_temp_files_are_removed_at_start(tmp_path):
    spec = block_spec("f32")
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as store:
        pass
    stale, fresh = store.path / ".tmp-dead.kvb", store.path / ".tmp-live.kvb"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600,) * 2)
    with DiskKVStore(tmp_path, MB, FIELDS, spec) as again:
        assert len(again) == 0
    assert not stale.exists() and fresh.exists()  # a young one may be another process's write


def test_clear_errors(tmp_path):
    spec = block_spec("bf16")
    with pytest.raises(ValueError, match="max_bytes=100 holds no block: one block file takes"):
        DiskKVStore(tmp_path, 100, FIELDS, spec)
    with pytest.raises(TypeError, match="not JSON-serializable"):
        DiskKVStore(tmp_path, MB, {"model": object()}, spec)
    with pytest.raises(TypeError, match="key_fields must be a dict"):
        DiskKVStore(tmp_path, MB, ["model"], spec)
    with pytest.raises(ValueError, match="max_pending_writes"):
        DiskKVStore(tmp_path, MB, FIELDS, spec, max_pending_writes=0)
    with DiskKVStore(tmp_path, MB, {**FIELDS, "dtype": np.dtype("float32")}, spec) as store:
        with pytest.raises(ValueError, match="'k': dtype float32, expected bfloat16"):
            wrong = {n: a.astype(np.float32) for n, a in random_block(spec, np.random.default_rng(0)).items()}
            store.put(key(0), wrong)
        with pytest.raises(TypeError, match="block key"):
            store.get("abc")
        assert store.stats()["disk_kv_pending_writes"] == 0
