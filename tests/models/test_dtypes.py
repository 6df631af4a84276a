"""What dtype="auto" and kv_cache_dtype="auto" resolve to (models/dtypes.py)."""
import jax.numpy as jnp
import pytest

from pagedjax import platforms
from pagedjax.models import dtypes
from pagedjax.models.dtypes import AUTO_DTYPE_ENV, auto_dtype, has_fast_bf16, resolve_dtype, resolve_kv_cache_dtype


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)  # tests/conftest.py pins "auto" to float32


@pytest.mark.parametrize("flags,want", [({"avx512f", "avx512_bf16"}, "bfloat16"), ({"amx_bf16", "amx_tile"}, "bfloat16"),
                                        ({"avx512f", "avx2"}, "float32"), (set(), "float32")])
def test_auto_follows_the_cpu_flags(unpinned, monkeypatch, flags, want):
    monkeypatch.setattr(platforms.cpu, "cpu_flags", lambda: frozenset(flags))
    assert auto_dtype() == want
    assert resolve_dtype("auto") == jnp.dtype(want)


def test_accelerators_have_fast_bf16():
    assert has_fast_bf16("tpu")


def test_the_environment_pins_auto(unpinned, monkeypatch):
    monkeypatch.setattr(platforms.cpu, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto") == jnp.float32
    assert resolve_dtype("bfloat16") == jnp.bfloat16  # an explicit dtype is never overridden
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=AUTO_DTYPE_ENV):
        resolve_dtype("auto")


def test_the_suite_runs_in_float32():
    """conftest.py pins "auto" for the tests that compare with float32 transformers."""
    assert resolve_dtype("auto") == jnp.float32


def test_cpu_flags_are_read_from_proc_cpuinfo():
    flags = dtypes.cpu_flags()
    assert isinstance(flags, frozenset)
    assert not flags or "fpu" in flags or "fp" in flags or "sse2" in flags


def test_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert resolve_kv_cache_dtype("auto", jnp.float32) == jnp.float32
    assert resolve_kv_cache_dtype("auto", jnp.float16) == jnp.float32  # the kernels take f32 or bf16 pages
    assert resolve_kv_cache_dtype("float32", jnp.bfloat16) == jnp.float32
    assert resolve_kv_cache_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", jnp.float32)
    assert resolve_kv_cache_dtype("int8", jnp.float32) == jnp.int8
    assert resolve_kv_cache_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8")
