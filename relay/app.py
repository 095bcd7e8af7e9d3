"""The relay: FastAPI app turning HTTP into NATS requests and token batches into SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenpipe.bus import Bus, connect
from tokenpipe.errors import InvalidRequest, ModelNotFound, NoGenerator, StreamNotFound, TokenpipeError
from tokenpipe.settings import Settings
from tokenpipe.streams import Ping, cancel, follow, get_meta, submit
from tokenpipe.subjects import ANNOUNCE_PREFIX, DISCOVER_SUBJECT, check_model_name, request_subject
from tokenpipe.telemetry import extract_context, get_tracer, inject_headers
from tokenpipe.wire import CoalesceParams, SamplingParams, TokenBatch
from tokenpipe.wire import Request as TpRequest

from .registry import GeneratorRegistry
from .sse import SSE_HEADERS, sse_comment, sse_event

__all__ = ["create_app", "RelayState"]

log = logging.getLogger(__name__)

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos"}
_NATIVE_KEYS = _SAMPLING_KEYS | {"model", "prompt", "messages", "input_ids", "coalesce", "cancel_on_disconnect"}


def error_body(message: str, *, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "server_error")


def error_response(exc: TokenpipeError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, type_=_error_type(exc.status), code=exc.code, param=exc.param),
                        status_code=exc.status)


class RelayState:
    """What one relay process holds: settings, the NATS bus, the generator registry."""

    def __init__(self, settings: Settings, tracer_provider: TracerProvider | None = None) -> None:
        self.settings = settings
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.registry = GeneratorRegistry()
        self.bus: Bus | None = None
        self.background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.bus = await connect(self.settings, name="tokenpipe-relay")
        nc = self.bus.nc
        await nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=self._on_announce)
        # Ask running generators to introduce themselves instead of waiting a full interval.
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=self._on_announce)
        await nc.publish(DISCOVER_SUBJECT, b"", reply=inbox)

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    async def _on_announce(self, msg: Any) -> None:
        self.registry.update(msg.data)

    def require_bus(self) -> Bus:
        if self.bus is None or not self.bus.nc.is_connected:
            raise NoGenerator("relay is not connected to NATS")
        return self.bus

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def resolve_model(self, model: Any) -> str:
        if model is None:
            models = self.registry.models()
            model = self.settings.model if self.settings.model in models or not models else models[0]
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string", param="model")
        check_model_name(model)
        deadline = time.monotonic() + self.settings.generator_wait_s
        while not self.registry.has_model(model):
            if time.monotonic() >= deadline:
                if model in self.registry.seen_models:
                    raise NoGenerator(f"no generator is currently serving model {model!r}")
                known = ", ".join(self.registry.models()) or "none yet"
                raise ModelNotFound(f"model {model!r} is not served here (available: {known})", param="model")
            await asyncio.sleep(0.1)  # waiting for an announcement to arrive; bounded by generator_wait_s
        return model


def _tenant(request: Request) -> str:
    return str(getattr(request.state, "tenant", "default"))


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(limit)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _TooLarge(limit)
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidRequest("request body must be a JSON object")
    return obj


class _TooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


def native_request(body: dict[str, Any], model: str, tenant: str, settings: Settings) -> TpRequest:
    unknown = sorted(set(body) - _NATIVE_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    params = SamplingParams.from_map({k: body[k] for k in _SAMPLING_KEYS if k in body})
    if params.max_tokens > settings.max_tokens_cap:
        raise InvalidRequest(f"'max_tokens' may be at most {settings.max_tokens_cap} here", param="max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt) > settings.max_prompt_chars:
        raise InvalidRequest(f"prompt exceeds {settings.max_prompt_chars} characters", param="prompt")
    messages = body.get("messages")
    if isinstance(messages, list) and sum(len(str(m.get("content", ""))) for m in messages
                                          if isinstance(m, dict)) > settings.max_prompt_chars:
        raise InvalidRequest(f"messages exceed {settings.max_prompt_chars} characters", param="messages")
    return TpRequest.from_map({
        "id": TpRequest.create(model, prompt="").id,
        "model": model,
        "prompt": prompt,
        "messages": messages,
        "input_ids": body.get("input_ids"),
        "params": params.to_map(),
        "coalesce": CoalesceParams.from_map(body.get("coalesce")).to_map(),
        "tenant": tenant,
        "created_at": time.time_ns(),
    })


def create_app(settings: Settings, tracer_provider: TracerProvider | None = None) -> FastAPI:
    state = RelayState(settings, tracer_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="tokenpipe relay", version="0.1.0", lifespan=lifespan)
    app.state.relay = state

    @app.exception_handler(TokenpipeError)
    async def _tp_error(request: Request, exc: TokenpipeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc.errors()[:3]), type_="invalid_request_error", code="invalid_request"),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), type_=_error_type(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        connected = state.bus is not None and state.bus.nc.is_connected
        models = state.registry.models()
        ready = connected and bool(models)
        return JSONResponse({"ready": ready, "nats": connected, "models": models}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "tokenpipe", "created": 0}
                                           for m in state.registry.models()]}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        page = resources.files("relay").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    @app.post("/v1/streams", status_code=201)
    async def create_stream(request: Request) -> JSONResponse:
        body = await read_json(request, settings.max_body_bytes)
        model = await state.resolve_model(body.get("model"))
        req = native_request(body, model, _tenant(request), settings)
        bus = state.require_bus()
        ctx = extract_context(request.headers)
        with state.tracer.start_as_current_span(f"publish {request_subject(model)}", context=ctx,
                                                kind=SpanKind.PRODUCER, attributes={
                                                    "messaging.system": "nats",
                                                    "messaging.operation.type": "publish",
                                                    "messaging.destination.name": request_subject(model),
                                                    "gen_ai.request.model": model,
                                                    "tokenpipe.stream.id": req.id}):
            await submit(bus, req, inject_headers())
        log.info("stream created", extra={"request_id": req.id, "model": model})
        return JSONResponse({"id": req.id, "model": model, "stream_url": f"/v1/streams/{req.id}"},
                            status_code=201, headers={"X-Request-Id": req.id, "Location": f"/v1/streams/{req.id}"})

    @app.get("/v1/streams/{stream_id}")
    async def get_stream(stream_id: str, request: Request, last_event_id: int | None = None,
                         cancel_on_disconnect: bool = True) -> Response:
        bus = state.require_bus()
        meta = await get_meta(bus, stream_id)
        if meta.tenant != _tenant(request):
            raise StreamNotFound(f"stream {stream_id!r} not found")
        header_id = request.headers.get("last-event-id")
        after = last_event_id if last_event_id is not None else -1
        if header_id is not None:
            if not header_id.strip().lstrip("-").isdigit():
                raise InvalidRequest("Last-Event-ID must be a batch sequence number", param="Last-Event-ID")
            after = int(header_id)
        return StreamingResponse(
            _sse_stream(state, bus, stream_id, after, cancel_on_disconnect),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, "X-Request-Id": stream_id},
        )

    @app.delete("/v1/streams/{stream_id}")
    async def delete_stream(stream_id: str, request: Request) -> dict[str, Any]:
        bus = state.require_bus()
        meta = await get_meta(bus, stream_id)
        if meta.tenant != _tenant(request):
            raise StreamNotFound(f"stream {stream_id!r} not found")
        await cancel(bus, stream_id)
        return {"id": stream_id, "cancelled": True}

    return app


async def _sse_stream(state: RelayState, bus: Bus, stream_id: str, after: int,
                      cancel_on_disconnect: bool) -> AsyncIterator[bytes]:
    agen = follow(bus, stream_id, after_seq=after, idle=state.settings.keepalive_s)
    finished = False
    try:
        async for item in agen:
            if isinstance(item, Ping):
                yield sse_comment()
                continue
            batch: TokenBatch = item
            out = b""
            if batch.token_ids or batch.text or not batch.is_final:
                out += sse_event(_tokens_json(batch),
                                 event="tokens", id=batch.seq)
            if batch.is_final:
                finished = True
                if batch.finish == "error":
                    out += sse_event({"message": batch.error or "generation failed", "finish": "error",
                                      "usage": batch.usage.to_map() if batch.usage else None},
                                     event="error", id=batch.seq)
                else:
                    out += sse_event({"finish": batch.finish,
                                      "usage": batch.usage.to_map() if batch.usage else None},
                                     event="done", id=batch.seq)
            yield out
    except TokenpipeError as exc:
        finished = True
        yield sse_event({"message": exc.message, "code": exc.code}, event="error")
    finally:
        # The client may be gone and this scope cancelled: shield the clean-up awaits.
        with anyio.CancelScope(shield=True):
            await agen.aclose()
            if not finished and cancel_on_disconnect:
                log.info("client disconnected; cancelling", extra={"request_id": stream_id})
                await cancel(bus, stream_id)


def _tokens_json(batch: TokenBatch) -> dict[str, Any]:
    return {"seq": batch.seq, "index": batch.index, "token_ids": list(batch.token_ids), "text": batch.text,
            "timings": dict(batch.timings)}
