"""HTTP plumbing shared by the relay's routers: OpenAI-style errors, bounded JSON bodies,
and an SSE response that drops a client that stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from tokenpipe.errors import GenerationError, InvalidRequest, TokenpipeError
from tokenpipe.wire import TokenBatch

from .sse import SSE_HEADERS

__all__ = ["RAW_SEND", "error_body", "error_response", "read_json", "parse_json", "RequestTooLarge",
           "JSONBodyRoute", "takes", "SSEResponse", "WriteWatchdog", "Writer", "ClientGone", "stream_error"]

# Scope key under which the relay app leaves the server's own ``send``: an SSE body chunk then
# skips three middleware wrappers that only ever look at the response start (they were 4 % of the
# relay's profile samples at 20,000 batches/s).
RAW_SEND = "tokenpipe.raw_send"

log = logging.getLogger(__name__)
E = TypeVar("E", bound=Callable[..., Any])


# The OpenAI error ``type`` of each status the relay answers with; any other is a server error.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                503: "service_unavailable_error"}


def error_body(message: str, *, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def stream_error(batch: TokenBatch) -> tuple[int, dict[str, Any]]:
    """A stream that ended in error (its final batch) as an HTTP status and an OpenAI error body:
    a request the generator refused as invalid is the caller's error (400), any other failure
    the server's (500)."""
    status = InvalidRequest.status if batch.error_code == InvalidRequest.code else GenerationError.status
    return status, error_body(batch.error or "generation failed", status=status, code=batch.error_code)


def error_response(exc: TokenpipeError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    retry = getattr(exc, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return JSONResponse(error_body(exc.message, status=exc.status, code=exc.code, param=exc.param),
                        status_code=exc.status, headers=headers or None)


class ClientGone(TokenpipeError):
    """The client closed the connection before its request body arrived: nobody to answer."""

    status = 499  # nginx's "client closed request": counted as the client's doing, not a 500
    code = "client_closed_request"


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


class JSONBodyRoute(APIRoute):
    """A route whose JSON body passes :func:`parse_json`'s checks, within the relay's size
    limit, before FastAPI validates it against the route's model: FastAPI's own parser would
    pass lone surrogates on (msgpack and the tokenizer fail on them later) and answer too
    many digits or too deep a nesting without saying which."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked(request: Request) -> Response:
            # As FastAPI's strict default: a page on another site cannot send this without CORS'
            # consent, as it could a text/plain body or one without a type (the relay on loopback
            # has no key by default).
            if not _JSON_TYPE.match(request.headers.get("content-type", "")):
                raise InvalidRequest("the request body must be JSON, sent with content-type: application/json",
                                     param="content-type")
            request._json = await read_json(request, request.app.state.relay.settings.max_body_bytes)
            return await handler(request)  # FastAPI's request.json() returns the checked value

        return checked


def takes(model: type[BaseModel]) -> Callable[[E], E]:
    """Give an endpoint's ``body`` parameter this app's model (built per app: it carries the
    relay's own limits, see :class:`relay.protocol.Bodies`), for FastAPI to validate and document."""
    def declare(endpoint: E) -> E:
        endpoint.__annotations__["body"] = model
        return endpoint
    return declare


_JSON_TYPE = re.compile(r"\s*application/([\w.+-]*\+)?json\s*(;|$)", re.IGNORECASE)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestTooLarge(limit)
    except ClientDisconnect as exc:
        raise ClientGone("the client closed the connection mid-body") from exc
    request._body = bytes(body)  # read once: Starlette's body() and json() serve it from here
    return parse_json(request._body)


def parse_json(body: bytes) -> dict[str, Any]:
    """The one boundary where untrusted JSON becomes Python values, shared by every route (and
    WebSocket frame): what the parser accepts but nothing downstream can carry is a 400 here.
    Integers past Python's digit limit, nesting past the recursion limit, and lone UTF-16
    surrogates (``"\\ud800"`` is valid JSON but not UTF-8: msgpack and the tokenizer fail on it)."""
    try:
        obj = json.loads(body)
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and the int digit limit alike
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_strings(obj)
    return obj


def _check_strings(obj: Any) -> None:
    """Refuse (400, naming the field) any key or string inside ``obj`` that is not valid UTF-8;
    iterative, so a deep structure cannot overflow the stack here either."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_utf8(value, path or "request body")
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                _check_utf8(key, f"a key in {path or 'the request body'}")
                stack.append((sub, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _check_utf8(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        safe = field.encode("utf-8", "backslashreplace").decode("utf-8")
        raise InvalidRequest(f"'{safe}' contains a lone UTF-16 surrogate, which is not valid UTF-8",
                             param=safe.split(".")[0].split("[")[0] or None) from exc


class Writer(Protocol):
    """A response or socket the :class:`WriteWatchdog` can cut off: ``abandon`` ends its blocked write."""

    def abandon(self) -> None: ...


class WriteWatchdog:
    """Ends SSE responses (and WebSockets) whose write has been blocked longer than ``timeout`` seconds
    (a client that stops reading). One task checks every response mid-write, instead of a cancel
    scope around every write (about a tenth of the relay's CPU at 20,000 events/s): a write that does
    not block never yields to it, so for that write the bookkeeping is one dict insert and one delete."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._writing: dict[Writer, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def begin(self, response: Writer) -> None:
        self._writing[response] = time.monotonic()
        if (self._task is None or self._task.done()) and not self._stopped:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sse-write-watchdog")

    def end(self, response: Writer) -> None:
        self._writing.pop(response, None)

    async def _run(self) -> None:
        period = min(1.0, max(0.02, self.timeout / 4))
        while self._writing:
            await asyncio.sleep(period)  # a periodic check: the deadline's precision is a quarter of it
            cutoff = time.monotonic() - self.timeout
            for response, started in list(self._writing.items()):
                if started < cutoff:
                    self._writing.pop(response, None)
                    response.abandon()

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class SSEResponse(StreamingResponse):
    """``text/event-stream`` whose writes the :class:`WriteWatchdog` cuts off. ``on_drop`` lets the
    caller keep the generation running for the client to resume; ``on_close`` runs however the
    response ends, even if the body was never read."""

    def __init__(self, content: AsyncIterator[bytes], *, watchdog: WriteWatchdog, stream_id: str,
                 on_drop: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": stream_id})
        self.watchdog = watchdog
        self.stream_id = stream_id
        self.on_drop = on_drop
        self.on_close = on_close
        self._scope: anyio.CancelScope | None = None
        self._raw_send: Send | None = None

    def abandon(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()  # runs even when the client left before the body was ever read

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._raw_send or send  # the start went through the middlewares; body chunks need not
        iterator = self.body_iterator
        watchdog = self.watchdog
        with anyio.CancelScope() as cancel_scope:
            self._scope = cancel_scope
            async for chunk in iterator:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                watchdog.begin(self)
                try:
                    await body_send({"type": "http.response.body", "body": data, "more_body": True})
                finally:
                    watchdog.end(self)
        if cancel_scope.cancelled_caught:
            log.warning("dropping slow SSE client: a write blocked too long",
                        extra={"request_id": self.stream_id, "send_timeout_s": watchdog.timeout})
            if self.on_drop is not None:
                self.on_drop()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            return  # the server closes the connection; the client may resume with Last-Event-ID
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})
