"""host_buffer: a step's numpy inputs packed into one int32 buffer and unpacked bit for bit inside jit."""
import jax
import numpy as np
import pytest

from pagedjax.worker import host_buffer


def _tree(rng, ranks):
    return {"ids": rng.integers(-5, 1 << 30, 4 * ranks).astype(np.int32),
            "table": rng.integers(0, 99, (2 * ranks, 3)).astype(np.int32),
            "temp": np.array([0.0, -0.0, np.inf, -1.5, np.nan, 1e-30] * ranks, np.float32),
            "seed": np.array([0, 1, 0xFFFFFFFF, 0x80000000] * ranks, np.uint32),
            "flags": np.array([True, False] * ranks),
            "none": None}


@pytest.mark.parametrize("ranks", [1, 2])
def test_round_trip_is_bit_exact(ranks):
    tree = _tree(np.random.default_rng(0), ranks)
    buf, layout = host_buffer.pack(tree, ranks)
    assert buf.dtype == np.int32 and buf.shape == (ranks, sum(x.size for x in tree.values() if x is not None) // ranks)
    out = jax.jit(host_buffer.unpack, static_argnums=1)(buf, layout)
    assert out["none"] is None
    for k, want in tree.items():
        if want is None:
            continue
        got = np.asarray(out[k])
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert got.tobytes() == want.tobytes(), k  # NaN, -0.0 and 0xFFFFFFFF included


def test_each_row_holds_its_ranks_share():
    """Row r of the buffer holds rank r's rows of every leaf (so a dp-sharded buffer gives each
    rank exactly its own inputs)."""
    tree = {"a": np.arange(4, dtype=np.int32), "b": np.arange(10, 16, dtype=np.int32).reshape(6, 1)}
    buf, _ = host_buffer.pack(tree, 2)
    assert buf.tolist() == [[0, 1, 10, 11, 12], [2, 3, 13, 14, 15]]


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="float64"):
        host_buffer.pack({"x": np.zeros(2)})
    with pytest.raises(ValueError, match="data ranks"):
        host_buffer.pack({"x": np.zeros(3, np.int32)}, 2)
    with pytest.raises(ValueError, match="data ranks"):
        host_buffer.pack({"x": np.int32(3)})


def test_a_step_sends_its_host_inputs_in_one_transfer(tiny_checkpoints, monkeypatch):
    """A decode step puts its inputs on the device in one device_put, and its executables see
    device arrays only (a numpy argument would be one more transfer of its own)."""
    from pagedjax import SamplingParams
    from pagedjax.engine.llm_engine import LLMEngine
    from tiny_models import hf_greedy

    path, hf = tiny_checkpoints("llama")
    engine = LLMEngine(str(path), stream_text=False, block_size=8, max_num_seqs=4, max_model_len=64,
                       max_num_batched_tokens=32, async_scheduling=False)
    prompt = [5, 9, 13, 2, 7]
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt (compiles)
    runner = engine.runner
    seen = []
    wrap = lambda exe: lambda *args: seen.append([type(x) for x in jax.tree.leaves(args)]) or exe(*args)
    monkeypatch.setattr(runner, "_executables", {t: wrap(e) for t, e in runner._executables.items()})
    monkeypatch.setattr(runner, "_samplers", {s: wrap(e) for s, e in runner._samplers.items()})
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    steps = len(seen) // 2
    assert steps == 5 and len(puts) == steps  # one transfer a step
    assert all(issubclass(kind, jax.Array) for call in seen for kind in call)
    assert outs[-1].outputs[0].token_ids == hf_greedy(hf, prompt, 6)  # and the tokens are right
    # inputs laid out for another step size than the executables they would feed are refused
    small, big = runner.buckets.token_buckets()[:2]
    runner.compile_bucket(big)
    with pytest.raises(RuntimeError, match="not laid out"):
        runner._to_device(big, *runner._idle_inputs(small)[:2])
