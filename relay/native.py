"""The native stream API: create, read (SSE, with resume), cancel."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BeforeValidator, WithJsonSchema

from tokenpipe.errors import TokenpipeError
from tokenpipe.quota import request_cost
from tokenpipe.streams import Gap, Ping
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire import TokenBatch
from tokenpipe.wire.frames import MAX_SEQ, Speed

from .http import JSONBodyRoute, SSEResponse, takes
from .protocol import (
    ID_PATTERN,
    Bodies,
    ChatCompletionRequest,
    CompletionRequest,
    NativeCreate,
    NativeEvent,
    StreamCancelled,
    StreamCreated,
)
from .sessions import Session
from .sse import sse_comment, sse_event
from .state import RelayState

__all__ = ["batch_events", "gap_event", "router", "start_stream", "state_of", "tenant_of"]

_SEQ_RE = re.compile(r"[0-9]{1,18}")


def _seq(value: Any) -> Any:
    """ASCII digits only, the same for the query and the header: ``str.isdigit()`` also accepts
    '²', and a lax integer parse also accepts '3.0'."""
    if isinstance(value, str):
        if not _SEQ_RE.fullmatch(value.strip()):
            raise ValueError("must be a batch sequence number (0 to 10^18-1, ASCII digits only)")
        return int(value)
    return value


# Optional, but documented as the integer it must be when given ("null" is no sequence number).
Seq = Annotated[int | None, BeforeValidator(_seq),
                WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_SEQ})]
StreamId = Annotated[str, Path(pattern=ID_PATTERN)]
# OpenAPI links from a created stream to reading and cancelling it (a stateful client, and
# schemathesis, follow the id the 201 returns).
_LINKS = {name: {"operationId": op, "parameters": {"stream_id": "$response.body#/id"}}
          for name, op in (("ReadStream", "readStream"), ("CancelStream", "cancelStream"))}


def tenant_of(request: Request) -> str:
    return str(request.state.tenant)


def state_of(request: Request) -> RelayState:
    return request.app.state.relay  # type: ignore[no-any-return]


async def start_stream(state: RelayState, body: NativeCreate | ChatCompletionRequest | CompletionRequest,
                       tenant: str, *, follow: bool = False) -> tuple[TpRequest, Session]:
    """Create a stream from a validated body (``POST /v1/streams``, the WebSocket ``create`` frame,
    the OpenAI routes) and a session to read it; with ``follow``, its live reader is registered first."""
    model = await state.registry.resolve(body.model)
    req = body.to_request(model, tenant)
    await state.admission.admit(tenant, model, req.id, cost=request_cost(req.params.max_tokens, req.prompt_chars))
    return req, Session(req.id, tenant, live=await state.forwarder.submit(req, follow=follow))


def router(bodies: Bodies) -> APIRouter:
    """The native routes, taking this app's :class:`~relay.protocol.Bodies` models."""
    api = APIRouter(route_class=JSONBodyRoute)

    @api.post("/v1/streams", status_code=201, response_model=StreamCreated,
              responses={201: {"description": "the stream was created", "links": _LINKS}})
    @takes(bodies.native)
    async def create_stream(body: NativeCreate, request: Request) -> JSONResponse:
        req, _ = await start_stream(state_of(request), body, tenant_of(request))
        created = StreamCreated(id=req.id, model=req.model, stream_url=f"/v1/streams/{req.id}",
                                service_tier=req.served_tier)
        return JSONResponse(created.model_dump(), status_code=201,
                            headers={"X-Request-Id": req.id, "Location": created.stream_url})

    @api.get("/v1/streams/{stream_id}", operation_id="readStream", response_class=SSEResponse, status_code=200,
             responses={200: {"description": "the stream as server-sent events",
                              "content": {"text/event-stream": {"schema": NativeEvent.model_json_schema()}}}})
    async def get_stream(stream_id: StreamId, request: Request, last_event_id: Seq = None,
                         last_event_id_header: Annotated[Seq, Header(alias="Last-Event-ID")] = None,
                         cancel_on_disconnect: bool = True, replay: bool = False,
                         speed: Speed = 1.0) -> Response:
        """The stream as SSE: history first, then live, after the batch ``Last-Event-ID`` (or
        ``last_event_id``) names. ``replay=true`` re-times the history by the original gaps
        between batches divided by ``speed`` (0 = as fast as possible; each pause at most 5 s).
        A replay is for watching: it is not a reader and never cancels."""
        state = state_of(request)
        tenant = tenant_of(request)
        after = last_event_id_header if last_event_id_header is not None else last_event_id
        meta = await state.forwarder.owned_meta(stream_id, tenant)
        await state.forwarder.check_retained(meta)
        session = Session(stream_id, tenant, cancel_on_exit=cancel_on_disconnect and not replay, reader=not replay,
                          meta=meta)
        return SSEResponse(_native_events(state, session, -1 if after is None else after, speed if replay else None),
                           watchdog=state.watchdog, stream_id=stream_id, on_drop=session.dropped,
                           on_close=session.close)

    @api.delete("/v1/streams/{stream_id}", operation_id="cancelStream", response_model=StreamCancelled)
    async def delete_stream(stream_id: StreamId, request: Request) -> StreamCancelled:
        await state_of(request).forwarder.cancel(stream_id, tenant_of(request))
        return StreamCancelled(id=stream_id, cancelled=True)

    return api


async def _native_events(state: RelayState, session: Session, after: int,
                         speed: float | None) -> AsyncIterator[bytes]:
    try:
        async for item in state.forwarder.batches(session, after=after, idle=state.settings.keepalive_s, speed=speed):
            if isinstance(item, Ping):
                yield sse_comment()
            elif isinstance(item, Gap):
                yield sse_event(gap_event(item), event="gap")
            else:
                yield b"".join(sse_event(data, event=name, id=item.seq) for name, data in batch_events(item))
    except TokenpipeError as exc:
        yield sse_event({"message": exc.message, "code": exc.code}, event="error")


def batch_events(batch: TokenBatch) -> list[tuple[str, dict[str, Any]]]:
    """A batch as the native API's events, (name, data): ``tokens`` (unless a final batch holds
    none), then on the final batch ``done`` or ``error``. SSE and WebSocket frames carry this data."""
    events: list[tuple[str, dict[str, Any]]] = []
    if batch.token_ids or batch.text or not batch.is_final:
        events.append(("tokens", {"seq": batch.seq, "index": batch.index, "token_ids": list(batch.token_ids),
                                  "text": batch.text, "timings": dict(batch.timings)}))
    if batch.is_final:
        usage = batch.usage.to_map() if batch.usage else None
        if batch.finish == "error":
            events.append(("error", {"message": batch.error or "generation failed", "code": batch.error_code,
                                     "finish": "error", "usage": usage}))
        else:
            events.append(("done", {"finish": batch.finish, "usage": usage}))
    return events


def gap_event(gap: Gap) -> dict[str, Any]:
    """A ``gap`` event's data: say exactly what is missing rather than pretend it was never there."""
    return {"from_seq": gap.from_seq, "to_seq": gap.to_seq,
            "message": f"batches {gap.from_seq}..{gap.to_seq} are missing: {gap.reason}"}
