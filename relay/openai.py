"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (stream and non-stream).

A coalesced batch becomes one chunk; usage counts tokens, not chunks. Every response carries
``X-Request-Id`` = the tokenpipe stream id, so the stream can be replayed or resumed through
the native API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenpipe.errors import InvalidRequest, TokenpipeError
from tokenpipe.streams import Gap, Ping
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire import TokenBatch

from .http import SSEResponse, error_body, read_json, stream_error
from .native import build_request, check_max_tokens, state_of, tenant_of
from .sessions import Session
from .sse import sse_comment, sse_event
from .state import RelayState

__all__ = ["router"]

router = APIRouter()
log = logging.getLogger(__name__)

# Accepted and meaningful here, or accepted because their value changes nothing.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "parallel_tool_calls": None,
            "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None, "echo": False,
            "best_of": 1, "suffix": None, "top_logprobs": None, "service_tier": None, "store": None,
            "metadata": None, "prediction": None, "modalities": None, "reasoning_effort": None}
_UNCHANGED = object()


def _finish_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"  # OpenAI has no "cancelled"; the stream simply stopped


def _params(body: dict[str, Any]) -> dict[str, Any]:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key, _UNCHANGED)
        if value is _UNCHANGED or value is None or value == neutral:
            continue
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        raise InvalidRequest(f"'{key}' is not supported by this server", param=key)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", param="user")
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "stop", "seed", "top_k", "ignore_eos"):
        if body.get(key) is not None:
            params[key] = body[key]
    return params


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise InvalidRequest("'stream_options' must be an object like {\"include_usage\": true}",
                             param="stream_options")
    if not body.get("stream"):
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return bool(opts.get("include_usage", False))


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}]: only text content parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and m.get("role") == "assistant":
            content = ""
        out.append({"role": m.get("role"), "content": content})
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return {"prompt": prompt[0]}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"input_ids": prompt}
    raise InvalidRequest("'prompt' must be a string, a list with one string, or a list of token ids",
                         param="prompt")


async def _start(request: Request, chat: bool) -> tuple[RelayState, TpRequest, dict[str, Any], Session]:
    state = state_of(request)
    body = await read_json(request, state.settings.max_body_bytes)
    params = _params(body)
    for key in ("max_completion_tokens", "max_tokens"):  # both are checked, whichever is used
        if body.get(key) is not None:
            check_max_tokens(body[key], state.settings, key)
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise InvalidRequest("'model' must be a string", param="model")
    content = {"messages": _chat_messages(body.get("messages"))} if chat else _prompt(body.get("prompt"))
    _include_usage(body)
    model = await state.registry.resolve(body.get("model"))
    tenant = tenant_of(request)
    req = build_request(model=model, tenant=tenant, settings=state.settings, params=params, **content)
    await state.admission.admit(tenant, model, req.id)
    live = await state.forwarder.submit(req, follow=True)
    return state, req, body, Session(req.id, req.tenant, live=live)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    state, req, body, session = await _start(request, chat)
    created = int(time.time())
    if body.get("stream"):
        return SSEResponse(_chunks(state, session, req, created, chat, _include_usage(body)),
                           watchdog=state.watchdog, stream_id=req.id,
                           on_close=session.close)
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
    if final.finish == "error":
        status, body = stream_error(final)
        return JSONResponse(body, status_code=status, headers={"X-Request-Id": req.id})
    usage = final.usage.to_map() if final.usage else None
    full = "".join(text)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(final.finish), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": full}
    else:
        choice["text"] = full
    return JSONResponse({"id": _object_id(req.id, chat), "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": req.model, "choices": [choice], "usage": usage},
                        headers={"X-Request-Id": req.id})


async def _disconnected(request: Request) -> None:
    """Return once the client hangs up (the body was read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _object_id(stream_id: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + stream_id


def _data(obj: Any) -> bytes:
    return sse_event(obj)


async def _chunks(state: RelayState, session: Session, req: TpRequest, created: int, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    base: dict[str, Any] = {"id": _object_id(req.id, chat), "object": kind, "created": created, "model": req.model}
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
        return _data({**base, "choices": [choice]})

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
                    out += _data(stream_error(item)[1])
                else:
                    out += chunk(None, _finish_reason(item.finish))
                    if include_usage and item.usage:
                        out += _data({**base, "choices": [], "usage": item.usage.to_map()})
            if out:
                yield out
    except TokenpipeError as exc:
        yield _data(error_body(exc.message, status=exc.status, code=exc.code))
    yield b"data: [DONE]\n\n"
