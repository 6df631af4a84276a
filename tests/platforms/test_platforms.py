"""pagedjax.platforms: each backend's answers (built by name, no hardware needed), the
one-line description, and that the engine reads its backend decisions from the platform."""
import ast
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from pagedjax import platforms
from pagedjax.platforms import (AUTO_DTYPE_ENV, CPU_KV_BUDGET_BYTES, CpuPlatform, GpuPlatform, Platform, TpuPlatform,
                                current_platform, get_platform)

ROOT = Path(__file__).resolve().parents[2]
F32, BF16 = jnp.float32, jnp.bfloat16

# what each backend decides (the values the scattered checks gave before the platform object)
CHOICES = {
    #        scan   moe       select skip   barrier                 f32-HIGHEST lora width, smallest step
    "cpu": (False, "sorted", False, True, "conditional", False, 32, 1),
    "gpu": (True, "ragged", True, False, "optimization_barrier", True, 1, 8),
    "tpu": (True, "ragged", False, False, "optimization_barrier", True, 1, 8),
}


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)  # tests/conftest.py pins "auto" to float32


@pytest.fixture
def backend(monkeypatch):
    """Makes jax.default_backend() report a name (the engine traces as it would there)."""
    return lambda name: monkeypatch.setattr(jax, "default_backend", lambda: name)


@pytest.mark.parametrize("name", list(CHOICES))
def test_each_backend_answers_its_choices(name):
    p = get_platform(name)
    assert p.name == name and p.backend == name
    assert (p.scan_layers, p.moe_impl, p.select_conditionals, p.skip_by_conditional, p.fusion_barrier,
            p.precise_f32_dots, p.lora_width, p.min_step_tokens) == CHOICES[name]


def test_backend_names_map_to_their_family():
    assert {type(get_platform(n)) for n in ("gpu", "cuda", "rocm")} == {GpuPlatform}
    assert get_platform("cuda").backend == "cuda" and get_platform("cuda").name == "gpu"
    assert isinstance(get_platform("tpu"), TpuPlatform) and isinstance(get_platform("cpu"), CpuPlatform)
    assert get_platform("cpu") is get_platform("cpu")  # cached per backend
    with pytest.raises(ValueError, match="unknown backend 'metal'; expected one of"):
        get_platform("metal")


def test_an_unknown_backend_keeps_an_accelerators_defaults(backend):
    backend("neuron")
    p = current_platform()
    assert type(p) is Platform and p.backend == "neuron"
    assert p.scan_layers and p.moe_impl == "ragged" and not p.select_conditionals and not p.skip_by_conditional
    assert p.attention_impl(F32, 16, F32) == "ragged"  # ops' rule for a backend without a Pallas kernel


def test_current_platform_follows_the_backend(backend):
    assert current_platform() is get_platform(jax.default_backend())
    backend("tpu")
    assert current_platform() is get_platform("tpu")


@pytest.mark.parametrize("flags,want", [({"avx512f", "avx512_bf16"}, "bfloat16"), ({"amx_bf16"}, "bfloat16"),
                                        ({"avx512f", "avx2"}, "float32"), (set(), "float32")])
def test_cpu_auto_dtype_follows_its_flags(unpinned, flags, want):
    p = CpuPlatform(flags=frozenset(flags))
    assert p.fast_bf16 == (want == "bfloat16")
    assert p.auto_dtype == want


def test_the_environment_pins_auto_on_every_backend(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert {get_platform(n).auto_dtype for n in CHOICES} == {"float32"}
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=f"{AUTO_DTYPE_ENV} must be one of"):
        get_platform("tpu").auto_dtype


@pytest.mark.parametrize("capability,fast", [("7.5", False), ("8.0", True), ("9.0", True), (None, True), ("x", True)])
def test_gpu_bf16_by_compute_capability(unpinned, monkeypatch, capability, fast):
    monkeypatch.setattr(GpuPlatform, "device", lambda self: SimpleNamespace(compute_capability=capability))
    assert GpuPlatform().fast_bf16 is fast
    assert GpuPlatform().auto_dtype == ("bfloat16" if fast else "float32")
    assert get_platform("tpu").fast_bf16


def test_attention_choice_per_backend(monkeypatch):
    from pagedjax.pallas_kernels.paged_attention import cpu_native

    assert get_platform("tpu").attention_impl(BF16, 16, BF16) == "pallas_tpu"
    assert get_platform("tpu").attention_impl(BF16, 8, BF16) == "chunked"  # half a bf16 VMEM tile
    assert get_platform("gpu").attention_impl(F32, 16, F32) == "pallas_gpu"
    assert get_platform("rocm").attention_impl(F32, 24, F32) == "chunked"  # not a power of two
    native = jax.default_backend() == "cpu" and cpu_native.available()
    assert get_platform("cpu").attention_impl(F32, 16, BF16) == ("native" if native else "ragged")
    monkeypatch.setattr(cpu_native, "available", lambda: False)  # no compiler
    assert get_platform("cpu").attention_impl(F32, 16, F32) == "ragged"


@pytest.mark.parametrize("name", ["cpu", "gpu", "tpu", "cuda"])
def test_the_kernels_auto_is_the_platforms_choice(backend, name):
    """Where a caller passes impl="auto" to the kernels, they choose what the platform does."""
    from pagedjax.pallas_kernels.paged_attention import ops

    backend(name)
    cases = [(F32, 16, F32), (BF16, 16, BF16), (F32, 16, BF16), (BF16, 8, BF16), (F32, 24, F32), (F32, 32, jnp.int8)]
    assert [current_platform().attention_impl(*c) for c in cases] == [ops._resolve("auto", *c) for c in cases]


def test_native_kernels_only_on_the_cpu():
    from pagedjax.pallas_kernels import cpu_matmul

    assert get_platform("gpu").native_kernels() == () == get_platform("tpu").native_kernels()
    assert not get_platform("gpu").native_matmul(BF16) and not get_platform("tpu").native_head(F32)
    cpu = get_platform("cpu")
    kernels = cpu.native_kernels()
    assert ("bf16-matmul" in kernels) == cpu_matmul.available()
    assert ("avx2-matmul" in kernels) == cpu_matmul.avx2_available()
    assert ("int8-matmul" in kernels) == cpu_matmul.int8_available()
    assert cpu.native_matmul(BF16) and cpu.native_matmul(F32) and not cpu.native_matmul(jnp.float16)
    # the head too, wherever a kernel serves the dtype (each shape: cpu_matmul.supported)
    assert cpu.native_head(F32) and cpu.native_head(BF16) and not cpu.native_head(jnp.int8)


def test_kv_budget(monkeypatch):
    assert get_platform("cpu").kv_budget_bytes(10 << 30, 4) == CPU_KV_BUDGET_BYTES  # whatever the weights
    stats = {"bytes_limit": 80 << 30, "bytes_in_use": 2 << 30}
    monkeypatch.setattr(GpuPlatform, "device", lambda self: SimpleNamespace(memory_stats=lambda: stats))
    gpu = GpuPlatform()
    assert gpu.memory_bytes() == 80 << 30
    assert gpu.kv_budget_bytes(8 << 30) == int((70 << 30) * platforms.ACCELERATOR_KV_FRACTION)
    assert gpu.kv_budget_bytes(8 << 30, 2) == 2 * gpu.kv_budget_bytes(8 << 30)
    assert gpu.kv_budget_bytes(100 << 30) == 0
    assert get_platform("tpu").device() is None or jax.default_backend() == "tpu"  # not on this host
    assert TpuPlatform().kv_budget_bytes(0) == int((16 << 30) * platforms.ACCELERATOR_KV_FRACTION)  # no report


def test_engine_config_sizes_the_pool_from_the_platform(backend, monkeypatch):
    from pagedjax.config import EngineConfig

    cfg = EngineConfig(max_num_seqs=1000)
    cfg.max_model_len = 1024
    assert cfg.default_num_blocks(1 << 20, 0) == CPU_KV_BUDGET_BYTES >> 20
    backend("gpu")
    monkeypatch.setattr(GpuPlatform, "device", lambda self: SimpleNamespace(memory_stats=lambda: {
        "bytes_limit": 10 << 30, "bytes_in_use": 0}))
    assert cfg.default_num_blocks(1 << 20, 5 << 30) == int((5 << 30) * platforms.ACCELERATOR_KV_FRACTION) >> 20


@pytest.fixture
def cache_dir_config():
    """jax's compilation cache dir, set by the test and put back after it."""
    before = jax.config.jax_compilation_cache_dir
    yield lambda value: jax.config.update("jax_compilation_cache_dir", value)
    jax.config.update("jax_compilation_cache_dir", before)


def test_compile_cache_policy(monkeypatch, tmp_path, cache_dir_config):
    cache_dir_config(None)
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path))
    monkeypatch.delenv(platforms.COMPILE_CACHE_ENV, raising=False)
    for name in CHOICES:
        assert get_platform(name).compile_cache_dir() == str(tmp_path / "jax_compilation_cache")
        assert get_platform(name).compile_cache_min_secs == 0.0
    cache_dir_config(str(tmp_path / "mine"))
    assert get_platform("cpu").compile_cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv(platforms.COMPILE_CACHE_ENV, "0")
    assert get_platform("cpu").compile_cache_dir() is None


def test_describe_and_as_dict(unpinned, monkeypatch):
    cpu = CpuPlatform(flags=frozenset({"avx2", "avx512_bf16"}))
    line = cpu.describe()
    assert "\n" not in line and line.startswith("cpu: ")
    assert "cores" in line and "AVX512-BF16 AVX2" in line and "AVX512-VNNI" not in line
    assert f"dtype auto=bfloat16, attention={cpu.attention}, scan=off, moe=sorted" in line
    if cpu.native_kernels():
        assert f"native kernels {' '.join(cpu.native_kernels())}" in line
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert "dtype auto=float32" in cpu.describe()  # kept only while the pin is the same
    d = cpu.as_dict()
    json.dumps(d)
    assert d["name"] == "cpu" and d["scan_layers"] is False and d["moe_impl"] == "sorted"
    assert d["dtype_auto"] == "float32" and d["attention"] == cpu.attention and d["memory_bytes"] > 0
    assert d["native_kernels"] == list(cpu.native_kernels())
    monkeypatch.setattr(TpuPlatform, "device", lambda self: SimpleNamespace(
        device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 << 30}))
    assert TpuPlatform().describe() == ("tpu: TPU v5 lite (16.0 GiB), dtype auto=float32, attention=pallas_tpu, "
                                        "scan=on, moe=ragged, smallest step=8")
    assert TpuPlatform().as_dict()["select_conditionals"] is False and GpuPlatform().as_dict()["select_conditionals"]


def test_the_engine_reads_its_decisions_from_the_platform(backend):
    """On this CPU the engine's backend decisions are the CPU platform's; reported as a GPU
    backend, they follow (read at call / trace time)."""
    from pagedjax.models import lora, moe
    from pagedjax.models.loader import default_scan_layers
    from pagedjax.sample import select_cond

    def decisions():
        return default_scan_layers(), moe.resolve_impl("auto"), select_cond.selects(), lora.stack_shape(3, 5)

    assert jax.default_backend() == "cpu"
    assert decisions() == (False, "sorted", False, (4, 8))
    backend("gpu")
    assert decisions() == (True, "ragged", True, (3, 5))
    backend("tpu")
    assert decisions() == (True, "ragged", False, (3, 5))


def test_paged_cache_asks_the_platform_for_its_attention(backend, monkeypatch):
    """PagedKVCache(attention_impl="auto") runs what the platform picks for its pages."""
    from pagedjax.models import kv_cache

    seen = []
    monkeypatch.setattr(kv_cache, "packed_paged_attention", lambda *a, impl, **kw: seen.append(impl) or a[0])
    cache = kv_cache.PagedKVCache(num_blocks=4, block_size=16)
    kv = kv_cache.init_kv_cache(cache, 1, 2, 8, F32)
    md = kv_cache.AttentionMetadata(*(jnp.zeros(n, jnp.int32) for n in (2, 2, (1, 1), 1, 2)))
    q = jnp.zeros((2, 4, 8), F32)
    cache.update_and_attend(kv, 0, q, q[:, :2], q[:, :2], md, scale=1.0)
    assert seen == [current_platform().attention_impl(F32, 16, F32)]
    monkeypatch.setattr(platforms.CpuPlatform, "attention_impl", lambda self, *a: "reference")
    cache.update_and_attend(kv, 0, q, q[:, :2], q[:, :2], md, scale=1.0)
    assert seen[-1] == "reference"


# the kernels that choose their own lowering by the backend (docs/design/platforms.md)
KERNEL_LOWERING = {
    "pallas_kernels/paged_attention/ops.py": "impl='auto' for direct callers; which compiled kernel may run",
    "pallas_kernels/paged_attention/cpu_native.py": "the native kernels run on XLA:CPU only",
    "pallas_kernels/paged_attention/kv_quant.py": "fp8 pages stored as bytes on XLA:CPU",
    "pallas_kernels/dense_attention.py": "a loop trip count known when compiling on GPUs",
    "pallas_kernels/cpu_matmul/__init__.py": "the native matmuls run on XLA:CPU only",
}


def _asks_the_backend(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "default_backend":
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name == "default_backend" for a in node.names):
            return True
    return False


def test_no_one_else_asks_jax_for_the_backend():
    asking = {str(p.relative_to(ROOT)) for top in ("pagedjax", "models", "pallas_kernels")
              for p in sorted((ROOT / top).rglob("*.py")) if _asks_the_backend(p)}
    outside = {p for p in asking if not p.startswith("pagedjax/platforms/")}
    assert outside <= set(KERNEL_LOWERING), f"ask pagedjax.platforms instead: {sorted(outside - set(KERNEL_LOWERING))}"
    assert "pagedjax/platforms/__init__.py" in asking  # the check sees a real call
    assert all((ROOT / p).is_file() for p in KERNEL_LOWERING)


def test_stats_report_the_platform(tiny_checkpoints):
    """LLM.stats() (LLMEngine.stats()) carries describe()'s line as "platform"."""
    from pagedjax import LLM

    path, _ = tiny_checkpoints("llama")
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64, block_size=8, num_blocks=8, warmup=False)
    assert llm.stats()["platform"] == current_platform().describe()
    assert llm.stats()["platform"].startswith("cpu: ")


def test_serve_logs_the_platform_once_the_engine_is_built(caplog, monkeypatch):
    import logging

    import pagedjax.engine.llm_engine as llm_engine
    from pagedjax.entrypoints import cli
    from pagedjax.entrypoints.openai import api_server

    from entrypoints.openai.fake_engine import FakeEngine

    monkeypatch.setattr(llm_engine, "LLMEngine", lambda *a, **kw: FakeEngine())
    monkeypatch.setattr(api_server, "serve", lambda *a, **kw: 0)  # built, not served
    with caplog.at_level(logging.INFO, logger="pagedjax.entrypoints.openai"):
        assert cli.main(["serve", "--port", "0", "--no-warmup"]) == 0
    assert f"platform {current_platform().describe()}" in caplog.messages
