"""pagedjax: a JAX/Pallas LLM inference engine with a paged KV cache."""
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
