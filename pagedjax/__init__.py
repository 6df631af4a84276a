"""pagedjax: a JAX/Pallas LLM inference engine with a paged KV cache."""
from pathlib import Path as _Path

# The model and kernel packages live in the folders models/ and pallas_kernels/ beside this one
# and install as pagedjax.models and pagedjax.pallas_kernels (pyproject's package-dir). Run from
# a source checkout without installing (PYTHONPATH=.), they are found here.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "models").exists() and (_checkout / "models" / "llama.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821  (the package's own __path__)
from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedjax.pooling.params import PoolingParams
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):  # import the engine (and JAX) only when asked for
    if name == "__version__":
        from pagedjax.entrypoints.cli import package_version

        return package_version()
    if name == "LLM":
        from pagedjax.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedjax.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams",
           "BeamSearchOutput", "StructuredOutputsParams", "LoRARequest", "PoolingParams", "EmbeddingOutput",
           "EmbeddingRequestOutput"]
