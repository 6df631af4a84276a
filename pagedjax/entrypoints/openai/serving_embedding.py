"""/v1/embeddings in OpenAI's shape: one engine embedding request per input, prefilled and
pooled by the engine's Pooler (pooling type: the engine's `pooling_type`), L2-normalized;
`dimensions` keeps the first values and renormalizes; `encoding_format` "base64" sends each
embedding as base64 of its little-endian float32 bytes (what the `openai` client asks for and
decodes by default)."""
from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request

from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import EmbeddingRequest
from pagedjax.entrypoints.openai.serving_common import ServingBase
from pagedjax.entrypoints.openai.streaming import json_bytes, json_response
from pagedjax.outputs import EmbeddingRequestOutput
from pagedjax.pooling.params import PoolingParams

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)


class EmbeddingServing(ServingBase):
    """Handler of /v1/embeddings."""

    async def create(self, req: EmbeddingRequest, request: Request):
        model = self.served_model_name
        if not self.engine.embeddings_enabled:
            raise bad_request("this server's engine does not compute embeddings")
        if self.lora_of(req.model) is not None:
            raise bad_request("embeddings with a LoRA adapter are not supported: use the base model", "model")
        hidden = getattr(getattr(self.engine.engine, "model_config", None), "hidden_size", None)
        if req.dimensions is not None and (req.dimensions < 1 or (hidden is not None and req.dimensions > hidden)):
            raise bad_request(f"`dimensions` must be in [1, {hidden}] (the model's hidden size), got {req.dimensions}",
                              "dimensions")
        params = PoolingParams(dimensions=req.dimensions)
        prompts = await self.run_cpu(self.input_ids, req.input)
        streams = await self.submit_embeddings(f"embd-{uuid.uuid4().hex}", prompts, params, request)
        finals = await self.collect(request, streams)
        return json_response(await self.run_cpu(self.response_body, prompts, finals, req.encoding_format, model))

    def input_ids(self, given) -> list[list[int]]:
        """Token ids of each input (a string, strings, token ids or lists of token ids); 400 for
        an empty input or one longer than max_model_len."""
        if isinstance(given, str):
            given = [given]
        elif not given:
            raise bad_request("`input` must not be empty", "input")
        elif isinstance(given[0], int):
            given = [given]
        if len(given) > MAX_INPUTS:
            raise bad_request(f"at most {MAX_INPUTS} inputs per request", "input")
        out = []
        for x in given:
            ids = self.encode(x, "input") if isinstance(x, str) else list(x)
            if not ids:
                raise bad_request("`input` must not contain an empty string or token list", "input")
            self.check_prompt_ids(ids, "input")
            if len(ids) > self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"an input has {len(ids)} tokens. Shorten it.", "input", "context_length_exceeded")
            out.append(ids)
        return out

    async def submit_embeddings(self, request_id: str, prompts: list[list[int]], params: PoolingParams,
                                request: Request):
        """One engine embedding request per input; on any failure abort the ones already added."""
        if len(prompts) > self.engine.max_pending_requests:
            raise bad_request(f"this request has {len(prompts)} inputs, more than the {self.engine.max_pending_requests}"
                              f" this server queues at once; split it", "input")
        return await self.add_streams(
            len(prompts), lambda i: self.engine.add_embed_request(f"{request_id}-{i}", prompts[i], params), "input")

    @staticmethod
    def response_body(prompts: list[list[int]], finals: list, encoding_format: str | None, model: str) -> bytes:
        data = []
        for i, out in enumerate(finals):
            if not isinstance(out, EmbeddingRequestOutput):  # aborted by the engine (shutting down)
                raise APIError("the request was aborted before its embedding was computed", 503,
                               "service_unavailable_error", None, "unavailable")
            vec = np.asarray(out.outputs.embedding, np.float32)
            if encoding_format == "base64":
                embedding = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
            else:
                embedding = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        n = sum(map(len, prompts))
        return json_bytes({"object": "list", "data": data, "model": model,
                           "usage": {"prompt_tokens": n, "total_tokens": n}})
