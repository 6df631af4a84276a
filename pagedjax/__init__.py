"""pagedjax: a JAX/Pallas LLM inference engine with a paged KV cache."""
from pathlib import Path as _Path

# The model and kernel packages live in the folders models/ and pallas_kernels/ beside this one
# and install as pagedjax.models and pagedjax.pallas_kernels (pyproject's package-dir). Run from
# a source checkout without installing (PYTHONPATH=.), they are found here.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "models").exists() and (_checkout / "models" / "llama.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821  (the package's own __path__)
from pagedjax import _notices  # noqa: F401  (before transformers is imported anywhere)
from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedjax.pooling.params import PoolingParams
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams


_LAZY = {  # name -> module: imported (with JAX) only when asked for
    "LLM": "pagedjax.entrypoints.llm",
    "LLMEngine": "pagedjax.engine.llm_engine",
    "AsyncEngine": "pagedjax.engine.async_engine",
    "EngineConfig": "pagedjax.config",
}


def __getattr__(name):
    if name == "__version__":
        from pagedjax.entrypoints.cli import package_version

        return package_version()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")


def __dir__():  # the lazy names too, for dir() and completion
    return sorted(set(globals()) | set(__all__) | {"__version__"})


__all__ = ["LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "StructuredOutputsParams", "LoRARequest", "PoolingParams",
           "EmbeddingOutput", "EmbeddingRequestOutput"]
