"""The native stream API: create, read (SSE, with resume), cancel."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenpipe.errors import InvalidRequest, TokenpipeError
from tokenpipe.settings import Settings
from tokenpipe.streams import Gap, Ping
from tokenpipe.subjects import check_stream_id
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire import SamplingParams, TokenBatch

from .http import SSEResponse, read_json
from .sessions import Session
from .sse import sse_comment, sse_event
from .state import RelayState

__all__ = ["router", "build_request", "check_max_tokens", "tenant_of"]

router = APIRouter()

_SEQ_RE = re.compile(r"[0-9]{1,18}")
MAX_SEQ = 10**18 - 1  # the largest Last-Event-ID / last_event_id (18 digits)
MIN_SPEED, MAX_SPEED = 0.01, 1000.0  # replay pacing factors; 0 = as fast as possible
_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos"}
_NATIVE_KEYS = _SAMPLING_KEYS | {"model", "prompt", "messages", "input_ids", "coalesce"}


def tenant_of(request: Request) -> str:
    return str(request.state.tenant)


def state_of(request: Request) -> RelayState:
    return request.app.state.relay  # type: ignore[no-any-return]


def check_max_tokens(value: Any, settings: Settings, param: str = "max_tokens") -> None:
    """A ``max_tokens`` (or OpenAI's ``max_completion_tokens``) within the wire's bounds and this relay's cap."""
    try:
        tokens = SamplingParams.from_map({"max_tokens": value}).max_tokens
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message.replace("'max_tokens'", f"'{param}'"), param=param) from exc
    if tokens > settings.max_tokens_cap:
        raise InvalidRequest(f"'{param}' may be at most {settings.max_tokens_cap} here", param=param)


def build_request(*, model: str, tenant: str, settings: Settings, prompt: Any = None, messages: Any = None,
                  input_ids: Any = None, params: dict[str, Any] | None = None, coalesce: Any = None) -> TpRequest:
    """Validate everything the relay can check before anything is enqueued."""
    params = dict(params or {})
    if params.get("max_tokens") is None:  # the default may not exceed this relay's cap either
        params["max_tokens"] = min(SamplingParams().max_tokens, settings.max_tokens_cap)
    check_max_tokens(params["max_tokens"], settings)
    SamplingParams.from_map(params)
    chars = len(prompt) if isinstance(prompt, str) else 0
    if isinstance(messages, list):
        chars += sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    if chars > settings.max_prompt_chars:
        raise InvalidRequest(f"the prompt exceeds {settings.max_prompt_chars} characters",
                             param="messages" if messages is not None else "prompt")
    return TpRequest.build(model, prompt=prompt, messages=messages, input_ids=input_ids, params=params,
                           coalesce=coalesce, tenant=tenant)


@router.post("/v1/streams", status_code=201)
async def create_stream(request: Request) -> JSONResponse:
    state = state_of(request)
    body = await read_json(request, state.settings.max_body_bytes)
    unknown = sorted(set(body) - _NATIVE_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    model = await state.registry.resolve(body.get("model"))
    tenant = tenant_of(request)
    req = build_request(model=model, tenant=tenant, settings=state.settings, prompt=body.get("prompt"),
                        messages=body.get("messages"), input_ids=body.get("input_ids"),
                        params={k: body[k] for k in _SAMPLING_KEYS if k in body}, coalesce=body.get("coalesce"))
    await state.admission.admit(tenant, model, req.id)
    await state.forwarder.submit(req)
    return JSONResponse({"id": req.id, "model": model, "stream_url": f"/v1/streams/{req.id}"}, status_code=201,
                        headers={"X-Request-Id": req.id, "Location": f"/v1/streams/{req.id}"})


def _resume_point(request: Request, last_event_id: int | None) -> int:
    header = request.headers.get("last-event-id")
    if header is None:
        return last_event_id if last_event_id is not None else -1
    if not _SEQ_RE.fullmatch(header.strip()):  # ASCII digits only: str.isdigit() also accepts '²'
        raise InvalidRequest("Last-Event-ID must be a batch sequence number", param="Last-Event-ID")
    return int(header)


def _check_speed(speed: float) -> float:
    """0 (as fast as possible) or within [MIN_SPEED, MAX_SPEED]: a replay always ends."""
    if speed != 0 and not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails both comparisons
        raise InvalidRequest(f"'speed' must be 0 (as fast as possible) or between {MIN_SPEED:g} and {MAX_SPEED:g}",
                             param="speed")
    return speed


@router.get("/v1/streams/{stream_id}")
async def get_stream(stream_id: str, request: Request,
                     last_event_id: int | None = Query(None, ge=0, le=MAX_SEQ),
                     cancel_on_disconnect: bool = True, replay: bool = False, speed: float = 1.0) -> Response:
    """The stream as SSE: history first, then live. ``replay=true`` re-times the history by the
    original gaps between batches divided by ``speed`` (0 = as fast as possible, else 0.01..1000;
    each pause at most 5 s). A replay is for watching: it is not a reader and never cancels."""
    state = state_of(request)
    tenant = tenant_of(request)
    check_stream_id(stream_id)
    _check_speed(speed)
    after = _resume_point(request, last_event_id)
    meta = await state.forwarder.owned_meta(stream_id, tenant)
    await state.forwarder.check_retained(meta)
    session = Session(stream_id, tenant, cancel_on_exit=cancel_on_disconnect and not replay, reader=not replay)

    def dropped() -> None:
        session.cancel_on_exit = False  # a slow client is cut off, not its generation: it may resume

    return SSEResponse(_native_events(state, session, after, speed if replay else None),
                       watchdog=state.watchdog, stream_id=stream_id, on_drop=dropped,
                       on_close=session.close)


@router.delete("/v1/streams/{stream_id}")
async def delete_stream(stream_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    tenant = tenant_of(request)
    check_stream_id(stream_id)
    await state.forwarder.owned_meta(stream_id, tenant)
    await state.forwarder.cancel(stream_id)
    state.admission.release(tenant, stream_id)
    return {"id": stream_id, "cancelled": True}


async def _native_events(state: RelayState, session: Session, after: int,
                         speed: float | None) -> AsyncIterator[bytes]:
    try:
        async for item in state.forwarder.batches(session, after=after, idle=state.settings.keepalive_s, speed=speed):
            if isinstance(item, Ping):
                yield sse_comment()
            elif isinstance(item, Gap):
                # Say exactly what is missing rather than pretend it was never there.
                yield sse_event({"from_seq": item.from_seq, "to_seq": item.to_seq,
                                 "message": f"batches {item.from_seq}..{item.to_seq} are missing: {item.reason}"},
                                event="gap")
            else:
                yield _render(item)
    except TokenpipeError as exc:
        yield sse_event({"message": exc.message, "code": exc.code}, event="error")


def _render(batch: TokenBatch) -> bytes:
    out = b""
    if batch.token_ids or batch.text or not batch.is_final:
        out += sse_event({"seq": batch.seq, "index": batch.index, "token_ids": list(batch.token_ids),
                          "text": batch.text, "timings": dict(batch.timings)}, event="tokens", id=batch.seq)
    if batch.is_final:
        usage = batch.usage.to_map() if batch.usage else None
        if batch.finish == "error":
            out += sse_event({"message": batch.error or "generation failed", "code": batch.error_code,
                              "finish": "error", "usage": usage}, event="error", id=batch.seq)
        else:
            out += sse_event({"finish": batch.finish, "usage": usage}, event="done", id=batch.seq)
    return out
