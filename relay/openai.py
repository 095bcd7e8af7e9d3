"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (stream and non-stream).

A coalesced batch becomes one chunk; usage counts tokens, not chunks. ``X-Request-Id`` is the
stream id, so the stream can be replayed or resumed through the native API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenpipe.errors import TokenpipeError
from tokenpipe.streams import Gap, Ping
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire import TokenBatch

from .http import JSONBodyRoute, SSEResponse, error_body, stream_error, takes
from .native import start_stream, state_of, tenant_of
from .protocol import (
    AssistantMessage,
    Bodies,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    OpenAIEvent,
    Usage,
)
from .sessions import Session
from .sse import sse_comment, sse_event
from .state import RelayState

__all__ = ["completion_reply", "router"]

log = logging.getLogger(__name__)

_STREAMED: dict[int | str, dict[str, Any]] = {200: {"description": "a completion, or chunks as SSE with `stream: true`",
                   "content": {"text/event-stream": {"schema": OpenAIEvent.model_json_schema()}}}}


def _finish_reason(finish: str | None) -> Literal["stop", "length"]:
    return "length" if finish == "length" else "stop"  # OpenAI has no "cancelled"; the stream simply stopped


def router(bodies: Bodies) -> APIRouter:
    """The OpenAI-compatible routes, taking this app's :class:`~relay.protocol.Bodies` models."""
    api = APIRouter(route_class=JSONBodyRoute)

    @api.post("/v1/chat/completions", response_model=ChatCompletion, responses=_STREAMED)
    @takes(bodies.chat)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=True)

    @api.post("/v1/completions", response_model=Completion, responses=_STREAMED)
    @takes(bodies.completion)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=False)

    return api


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> Response:
    state = state_of(request)
    req, session = await start_stream(state, body, tenant_of(request), follow=True)
    created = int(time.time())
    if body.stream:
        return SSEResponse(_chunks(state, session, req, created, chat, body.include_usage),
                           watchdog=state.watchdog, stream_id=req.id, on_close=session.close)
    try:
        return await _complete_blocking(request, state, session, req, created, chat)
    finally:
        session.close()


async def _complete_blocking(request: Request, state: RelayState, session: Session, req: TpRequest, created: int,
                             chat: bool) -> Response:
    text: list[str] = []
    final: TokenBatch | None = None

    async def collect() -> None:
        nonlocal final
        async for item in state.forwarder.batches(session):
            if isinstance(item, TokenBatch):
                text.append(item.text)
                final = item
            elif isinstance(item, Gap):
                log.warning("tokens missing from a completion", extra={"request_id": req.id, "reason": item.reason})

    # A client that hangs up on a blocking completion cancels it, as a streaming one does.
    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not collector.done():
        collector.cancel()  # Forwarder.batches() cancels the generation on its way out
        with contextlib.suppress(asyncio.CancelledError):
            await collector
        return Response(status_code=499, headers={"X-Request-Id": req.id})  # nobody is listening
    collector.result()
    assert final is not None and final.is_final
    status, body = completion_reply(req, final, "".join(text), created, chat)
    return JSONResponse(body, status_code=status, headers={"X-Request-Id": req.id})


def completion_reply(req: TpRequest, final: TokenBatch, text: str, created: int,
                     chat: bool) -> tuple[int, dict[str, Any]]:
    """A finished stream (its ``final`` batch and whole ``text``) as the blocking completion's status
    and body: the OpenAI routes' answer, and a batch line's ``response`` (relay.batchrun)."""
    if final.finish == "error":
        return stream_error(final)
    usage = Usage(**final.usage.to_map()) if final.usage else None
    finish = _finish_reason(final.finish)
    reply: ChatCompletion | Completion
    if chat:
        reply = ChatCompletion(id=_object_id(req.id, chat), created=created, model=req.model, usage=usage,
                               service_tier=req.served_tier,
                               choices=[ChatChoice(finish_reason=finish, message=AssistantMessage(content=text))])
    else:
        reply = Completion(id=_object_id(req.id, chat), created=created, model=req.model, usage=usage,
                           service_tier=req.served_tier, choices=[CompletionChoice(finish_reason=finish, text=text)])
    return 200, reply.model_dump()


async def _disconnected(request: Request) -> None:
    """Return once the client hangs up (the body was read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _object_id(stream_id: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + stream_id


async def _chunks(state: RelayState, session: Session, req: TpRequest, created: int, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    base: dict[str, Any] = {"id": _object_id(req.id, chat), "object": kind, "created": created, "model": req.model,
                            "service_tier": req.served_tier}
    if include_usage:
        base["usage"] = None

    def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return sse_event({**base, "choices": [choice]})

    if chat:
        yield chunk("", None, first=True)
    try:
        async for item in state.forwarder.batches(session, idle=state.settings.keepalive_s):
            if isinstance(item, Ping):
                yield sse_comment()
                continue
            if isinstance(item, Gap):  # the OpenAI format has no way to say so in-band; the log does
                log.warning("tokens missing from a completion", extra={"request_id": req.id, "reason": item.reason})
                continue
            out = b""
            if item.text:
                out += chunk(item.text, None)
            if item.is_final:
                if item.finish == "error":
                    out += sse_event(stream_error(item)[1])
                else:
                    out += chunk(None, _finish_reason(item.finish))
                    if include_usage and item.usage:
                        out += sse_event({**base, "choices": [], "usage": item.usage.to_map()})
            if out:
                yield out
    except TokenpipeError as exc:
        yield sse_event(error_body(exc.message, status=exc.status, code=exc.code))
    yield b"data: [DONE]\n\n"
