"""The FastAPI app: routes, API-key check, request parsing and OpenAI-shaped errors.

Bodies are read with a size cap counted while reading (chunked uploads included) and must be
`application/json` (so a cross-site HTML form cannot start a generation); a 500 says only
that something went wrong, the details go to the server log.
"""
from __future__ import annotations

import contextlib
import copy
import hmac
import importlib.metadata
import logging
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedjax.engine.async_engine import AsyncEngine
from pagedjax.engine.request_stream import EngineDeadError
from pagedjax.entrypoints.chat_template import load_chat_template
from pagedjax.entrypoints.openai.control import add_control_routes
from pagedjax.entrypoints.openai.errors import APIError, bad_request, from_status
from pagedjax.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedjax.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  EmbeddingRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                                  UnloadLoRAAdapterRequest)
from pagedjax.entrypoints.openai.reasoning import ReasoningParser
from pagedjax.entrypoints.openai.response_bodies import ModelCard, ModelList
from pagedjax.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedjax.entrypoints.openai.serving_chat import ChatServing
from pagedjax.entrypoints.openai.serving_common import ClientDisconnected
from pagedjax.entrypoints.openai.serving_completion import CompletionServing
from pagedjax.entrypoints.openai.serving_embedding import EmbeddingServing
from pagedjax.entrypoints.openai.serving_responses import ResponsesServing
from pagedjax.entrypoints.openai.serving_tokenize import TokenizeServing

logger = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # default body cap
try:
    VERSION = importlib.metadata.version("pagedjax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
    VERSION = "unknown"


def _server_tokenizer(tokenizer):
    """A private copy of the tokenizer for the event loop, so it never shares the Rust
    object the engine thread detokenizes with."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # pragma: no cover - some tokenizers do not copy; sharing is still safe enough
        return tokenizer


def _param(errors: list[dict]) -> str:
    """A readable field path (`messages[0].content`): the common prefix of the error
    locations (a union reports one error per member, each with the member's tag appended)."""
    loc = list(errors[0]["loc"])
    for e in errors[1:]:
        n = 0
        while n < min(len(loc), len(e["loc"])) and loc[n] == e["loc"][n]:
            n += 1
        loc = loc[:n]
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body into `model`; any problem is a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        first = errors[0]
        if first["type"] in ("json_invalid", "json_type"):
            raise bad_request(f"Invalid JSON body: {first['msg']}") from None
        if first["type"] == "model_type" or not first["loc"]:
            raise bad_request("The request body must be a JSON object") from None
        field_errors = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
        param = _param(field_errors)
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unsupported field `{param}`: this server does not accept it", param) from None
        if first["type"] == "missing":
            raise bad_request(f"Missing required field `{param}`", param) from None
        msgs = list(dict.fromkeys(e["msg"] for e in field_errors))  # a union: one message per member
        raise bad_request(f"Invalid value for `{param}`: {' | '.join(msgs[:4])}", param) from None


PROTECTED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*: they run the tokenizer


class APIKeyMiddleware:
    """Pure ASGI middleware: /v1/*, /tokenize and /detokenize need `Authorization: Bearer
    <api_key>` (constant-time comparison); /health, /metrics and /version stay open."""

    def __init__(self, app, api_key: str, on_reject=None) -> None:
        self.app, self.expected, self.on_reject = app, api_key.encode(), on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in PROTECTED_PATHS):
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else b""
            if not hmac.compare_digest(given, self.expected):
                if self.on_reject is not None:
                    self.on_reject()
                response = APIError("Missing or incorrect API key: pass it as `Authorization: Bearer <key>`",
                                    401, "authentication_error", None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
              drain_timeout: float = 0.0, max_request_bytes: int = MAX_REQUEST_BYTES,
              send_timeout: float = 30.0, reasoning_parser: str | None = None,
              chat_template: str | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app in front of `async_engine` (started and shut down
    with the app's lifespan). `send_timeout`: seconds a streaming client may take no data
    before its request is aborted. `reasoning_parser`: a name of reasoning.REASONING_PARSERS
    (None: off), which splits `<think>` text off the content. `chat_template`: the chat
    template to serve instead of the tokenizer's (a Jinja file path or the template text)."""
    name = served_model_name or async_engine.model_name
    metrics = ServerMetrics(async_engine.stats)
    async_engine.metrics = metrics
    tokenizer = _server_tokenizer(async_engine.tokenizer)
    if chat_template is not None and tokenizer is not None:  # the server's copy: chat, /tokenize, tool detection
        tokenizer.chat_template = load_chat_template(chat_template)
    cpu = ThreadPoolExecutor(1, thread_name_prefix="pagedjax-cpu")
    completions = CompletionServing(async_engine, name, tokenizer, cpu, send_timeout)
    chat = ChatServing(async_engine, name, tokenizer, cpu, send_timeout)
    chat.reasoning_parser = ReasoningParser(reasoning_parser) if reasoning_parser else None
    responses = ResponsesServing(chat)
    tokenize = TokenizeServing(chat)
    embeddings = EmbeddingServing(async_engine, name, tokenizer, cpu, send_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown(drain_timeout)
        cpu.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedjax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    app.openapi = lambda: _openapi(app)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=lambda: metrics.on_error(401))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.on_error(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        metrics.on_error(exc.status_code)
        return from_status(exc.status_code, str(exc.detail)).response(getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug: say so, keep serving
        logger.exception("unhandled error on %r", request.url.path)  # repr: no raw control characters
        metrics.on_error(500)
        return APIError("internal server error (the details are in the server log)", 500, "server_error").response()

    too_large = APIError(f"the request body is larger than this server's limit of {max_request_bytes} bytes "
                         f"(--max-request-bytes)", 413)

    async def read_body(request: Request) -> bytes:
        """The body, at most max_request_bytes, counted as it arrives; must be JSON."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise APIError(f"the request body must be JSON, sent with `Content-Type: application/json` "
                           f"(got {kind[:64] or 'none'!r})", 415)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def generate(request: Request, model: type[BaseModel], serving) -> Response:
        try:
            req = parse_request(model, await read_body(request))
            return await serving.create(req, request)
        except (ClientDisconnect, ClientDisconnected):  # the client left: nobody to answer
            return Response(status_code=499)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def create_completion(request: Request):
        return await generate(request, CompletionRequest, completions)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def create_chat_completion(request: Request):
        return await generate(request, ChatCompletionRequest, chat)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def create_response(request: Request):
        return await generate(request, ResponsesRequest, responses)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False)
    @app.api_route("/v1/responses/{response_id}/{action}", methods=["GET", "POST"], include_in_schema=False)
    async def stored_response(response_id: str, action: str | None = None):
        raise APIError(f"no response {response_id!r}: this server stores no responses (`store` is accepted and "
                       "nothing is kept), so none can be retrieved, listed, cancelled or deleted", 404,
                       "not_found_error", "response_id")

    @app.post("/v1/embeddings", openapi_extra=_body_schema(EmbeddingRequest))
    async def create_embeddings(request: Request):
        return await generate(request, EmbeddingRequest, embeddings)

    async def answer(request: Request, model: type[BaseModel], handler) -> Response:
        try:
            return JSONResponse(await handler(parse_request(model, await read_body(request))))
        except ClientDisconnect:
            return Response(status_code=499)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize_route(request: Request):
        return await answer(request, TokenizeRequest, tokenize.tokenize)

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request):
        return await answer(request, DetokenizeRequest, tokenize.detokenize)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": VERSION})

    def model_cards() -> list[ModelCard]:
        """The base model, then each LoRA adapter (by id)."""
        max_len = async_engine.max_model_len
        adapters = sorted(async_engine.loras.values(), key=lambda lora: lora.lora_int_id)
        return [ModelCard(id=name, root=name, max_model_len=max_len)] + [
            ModelCard(id=lora.lora_name, root=lora.lora_path, parent=name, max_model_len=max_len)
            for lora in adapters]

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=model_cards()).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        card = next((c for c in model_cards() if c.id == model_id), None)
        if card is None:
            raise APIError(f"The model `{model_id}` does not exist", 404, "not_found_error", "model",
                           "model_not_found")
        return JSONResponse(card.model_dump())

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request):
        req = parse_request(LoadLoRAAdapterRequest, await read_body(request))
        check_lora_enabled()
        if req.lora_name == name:
            raise bad_request(f"`{name}` is the base model's name; give the adapter another", "lora_name")
        try:
            await async_engine.load_lora(req.lora_name, req.lora_path)
        except (ValueError, OSError) as exc:
            raise bad_request(f"cannot load LoRA adapter `{req.lora_name}`: {exc}", "lora_path") from None
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error", None, "unavailable") from None
        logger.info("loaded LoRA adapter %r from %r", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        req = parse_request(UnloadLoRAAdapterRequest, await read_body(request))
        check_lora_enabled()
        try:
            await async_engine.unload_lora(req.lora_name)
        except KeyError:
            raise APIError(f"The LoRA adapter `{req.lora_name}` is not loaded", 404, "not_found_error",
                           "lora_name", "model_not_found") from None
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error", None, "unavailable") from None
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def check_lora_enabled() -> None:
        if not async_engine.lora_enabled:
            raise bad_request("LoRA adapters are off on this server: start it with --enable-lora")

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return JSONResponse({"status": "error", "error": "the engine is not running (see the server log)"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_control_routes(app, async_engine)  # /reset_prefix_cache, /sleep, /wake_up, /is_sleeping
    return app


def _body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses `model` itself (its nested models are
    added to the components by `_openapi`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    """/openapi.json: FastAPI's schema plus the request models the handlers parse by hand."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, TokenizeRequest,
                      DetokenizeRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema
