"""The disk KV tier (kv_offload_dir) wired into the engine: full prefix blocks written through
as they are computed, read back by a restarted engine on the same folder (greedy outputs
token for token equal to a run without the tier, the prompt not recomputed), a corrupted or
truncated block file ignored (recomputed, same outputs), a changed block size, KV dtype or
model never reading the blocks, close() waiting for the writes, no block leaked."""
import os
from pathlib import Path

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine

BS, NUM_BLOCKS, DOC_BLOCKS = 8, 24, 8


def _engine(path, **kw):
    return LLMEngine(str(path), stream_text=False, block_size=kw.pop("block_size", BS), num_blocks=NUM_BLOCKS,
                     max_num_seqs=4, max_model_len=256, **kw)


def _prompts():
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 384, DOC_BLOCKS * BS).tolist() for _ in range(2)]
    return [doc + rng.integers(2, 384, 5).tolist() for doc in docs for _ in range(2)]


def _run(engine, prompts):
    """One request at a time (the second of each doc hits the first's blocks). -> outputs."""
    outs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    return outs


def _files(folder) -> list[Path]:
    return sorted(Path(folder).glob("*/*.kvb"))


def _no_leak(engine):
    assert not engine.has_unfinished_requests() and engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
    assert engine.kv_tiers._staged == {}


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    """The checkpoint, the outputs without any tier, and a folder filled by a first engine
    (closed by LLM's `with` exit)."""
    path, _ = tiny_checkpoints("llama")
    base = _run(_engine(path, async_scheduling=False), _prompts())
    folder = tmp_path_factory.mktemp("kv-disk")
    with LLM(str(path), warmup=False, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=4, max_model_len=256,
             kv_offload_dir=str(folder)) as llm:
        first = _run(llm.engine, _prompts())
        written = llm.stats()
    return path, base, folder, first, written


def test_close_waits_for_every_write(setup):
    path, base, folder, first, s = setup
    assert first == base  # writing through changes nothing
    # every full prompt block of both docs (the last request's blocks too: written by close())
    assert s["kv_offload_written_blocks"] >= 2 * DOC_BLOCKS
    files = _files(folder)
    assert len(files) >= 2 * DOC_BLOCKS and not list(Path(folder).glob("*/.tmp-*"))
    assert len({f.parent for f in files}) == 1 and (files[0].parent / "namespace.json").is_file()


@pytest.mark.parametrize("async_,disk_run", [(False, 64), (True, 3)])
def test_restart_reads_the_blocks_back(setup, async_, disk_run, monkeypatch):
    path, base, folder, _, _ = setup
    monkeypatch.setattr("pagedjax.core.kv_offload.DISK_RUN", disk_run)  # 3: each doc's 8 blocks in runs of 3, 3, 2
    engine = _engine(path, kv_offload_dir=str(folder), async_scheduling=async_)
    assert _run(engine, _prompts()) == base  # greedy, token for token
    s = engine.stats()
    # the first request of each doc loads its 8 blocks from disk (the second hits the device)
    assert s["kv_offload_disk_hit_tokens"] == 2 * DOC_BLOCKS * BS
    assert s["kv_offload_loaded_blocks"] == 2 * DOC_BLOCKS and s["disk_kv_corrupt"] == 0
    assert s["num_computed_prompt_tokens"] == sum(map(len, _prompts())) - s["prefix_cache_hit_tokens"] \
        - s["kv_offload_disk_hit_tokens"]
    assert "host_kv_blocks_total" not in s  # a disk tier alone: no host pool
    _no_leak(engine)
    engine.close_kv_tiers()
    engine.close_kv_tiers()  # idempotent
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    text = ServerMetrics(engine.stats).render().decode()
    assert f"pagedjax:kv_offload_disk_hit_tokens_total {float(s['kv_offload_disk_hit_tokens'])}" in text
    assert "# TYPE pagedjax:disk_kv_blocks_read_total counter" in text and "pagedjax:disk_kv_bytes " in text


def test_corrupt_and_truncated_files_are_recomputed(setup, tmp_path):
    path, base, folder, _, _ = setup
    copy = tmp_path / "copy"
    for f in _files(folder) + [next(Path(folder).glob("*/namespace.json"))]:
        (copy / f.parent.name).mkdir(parents=True, exist_ok=True)
        (copy / f.parent.name / f.name).write_bytes(f.read_bytes())
    flipped, cut = _block_file(copy, 0, 3), _block_file(copy, 2, 5)  # doc 0's block 3, doc 1's block 5
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload
    flipped.write_bytes(bytes(data))
    os.truncate(cut, cut.stat().st_size // 2)
    engine = _engine(path, kv_offload_dir=str(copy), async_scheduling=True)
    assert _run(engine, _prompts()) == base
    s = engine.stats()
    assert s["disk_kv_corrupt"] == 2  # detected (and removed)
    assert s["kv_offload_disk_hit_tokens"] == (3 + 5) * BS  # the chains stop at the bad blocks: the rest recomputed
    _no_leak(engine)
    engine.close_kv_tiers()  # the recomputed blocks were written through again, whole
    whole = _block_file(copy, 0, 0).stat().st_size
    assert flipped.stat().st_size == cut.stat().st_size == whole
    assert engine.kv_tiers.disk.get(bytes.fromhex(cut.stem)) is not None and engine.stats()["disk_kv_corrupt"] == 2


def _block_file(folder, prompt: int, block: int) -> Path:
    """The file of _prompts()[prompt]'s full block `block` (its chained key)."""
    from pagedjax.core.block_pool import hash_block

    tokens, key = _prompts()[prompt], None
    for i in range(block + 1):
        key = hash_block(key, tokens[i * BS:(i + 1) * BS])
    (path,) = Path(folder).glob(f"*/{key.hex()}.kvb")
    return path


def test_another_block_size_reads_nothing(setup):
    path, base, folder, _, _ = setup
    engine = _engine(path, kv_offload_dir=str(folder), block_size=16)
    _run(engine, _prompts())
    s = engine.stats()
    assert s["kv_offload_disk_hit_tokens"] == 0 and s["disk_kv_hits"] == 0
    engine.close_kv_tiers()
    assert len({f.parent for f in _files(folder)}) == 2  # its own namespace beside the first


def test_namespace_follows_model_dtype_and_weights(setup, tmp_path):
    """The key fields change with the KV dtype, the block size and the weight files (another
    checkpoint, or the same one rewritten)."""
    from pagedjax.worker.kv_disk_identity import disk_key_fields

    path, *_ = setup
    cfg = EngineConfig(model=str(path))
    fields = disk_key_fields(path, cfg, BS)
    assert fields == disk_key_fields(path, EngineConfig(model=str(path)), BS)
    assert fields != disk_key_fields(path, EngineConfig(model=str(path), kv_cache_dtype="int8"), BS)
    assert fields != disk_key_fields(path, cfg, 16)
    other = tmp_path / "other"
    other.mkdir()
    for f in Path(path).iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    moved = disk_key_fields(other, cfg, BS)
    assert moved["config"] == fields["config"] and moved != fields
    weights = next(other.glob("*.safetensors"))
    before = disk_key_fields(other, cfg, BS)
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert disk_key_fields(other, cfg, BS)["weights"] != before["weights"]


def test_update_weights_stops_the_disk_tier(setup, tmp_path):
    from safetensors.numpy import load_file

    path, base, folder, _, _ = setup
    engine = _engine(path, kv_offload_dir=str(tmp_path / "d"), async_scheduling=False)
    engine.update_weights(load_file(str(next(Path(path).glob("*.safetensors")))))
    assert engine.kv_tiers.disk is None  # its blocks are the files' KV, not these weights'
    assert _run(engine, _prompts()[:1]) == base[:1] and engine.stats()["kv_offload_disk_hit_tokens"] == 0


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offload_dir=""), "kv_offload_dir must be a folder path"),
    (dict(kv_offload_dir=3), "kv_offload_dir must be a folder path"),
    (dict(kv_offload_dir="/tmp", kv_offload_disk_gb=0), "kv_offload_disk_gb must be a number > 0"),
    (dict(kv_offload_dir="/tmp", kv_offload_disk_gb="1"), "kv_offload_disk_gb must be a number > 0"),
    (dict(kv_offload_dir="/tmp", kv_cache="dense"), "kv_offload_dir needs kv_cache='paged'"),
    (dict(kv_offload_dir="/tmp", enable_prefix_caching=False), "kv_offload_dir needs prefix caching"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_config_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        EngineConfig(kv_offload_dir=str(tmp_path / "f"))
    assert EngineConfig().kv_offload_dir is None


def test_weights_from_memory_refused(setup, tmp_path):
    from safetensors.numpy import load_file

    path, *_ = setup
    weights = load_file(str(next(Path(path).glob("*.safetensors"))))
    with pytest.raises(ValueError, match="kv_offload_dir needs the weights of the model folder"):
        LLMEngine(str(path), weights=weights, kv_offload_dir=str(tmp_path), num_blocks=NUM_BLOCKS, block_size=BS,
                  max_model_len=256)


def test_server_shutdown_flushes_the_writes(setup, tmp_path):
    """AsyncEngine.shutdown (the server's) writes the blocks the last step completed and waits."""
    import asyncio

    from pagedjax.engine.async_engine import AsyncEngine

    path, *_ = setup
    engine = _engine(path, kv_offload_dir=str(tmp_path), async_scheduling=False)
    _run(engine, [_prompts()[0][:67]])  # 67 + 5 computed tokens: the last step completes block 9
    tiers = engine.kv_tiers
    pending = sum(len(p.prefix.written) for p in tiers.policies) + sum(len(w) for _, w, _ in tiers._pending)
    assert pending > 0  # not queued for the disk yet: no step after them
    server = AsyncEngine(engine)
    server.start()
    asyncio.run(server.shutdown())
    s = engine.stats()
    assert s["disk_kv_pending_writes"] == 0 and s["disk_kv_blocks_written"] == len(_files(tmp_path)) >= 9
    assert not engine.kv_tiers.disk_writable
