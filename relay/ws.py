"""The WebSocket transport, ``/v1/ws``: one socket carries any number of its tenant's streams.

Frames are JSON text (README, "WebSocket"); every client frame gets a reply or an ``error``
frame, and a bad frame never closes the socket. Streams are created, read and cancelled through
the HTTP API's own paths (:func:`relay.native.start_stream`, ``Forwarder.batches``,
``Forwarder.cancel``), so tenancy, admission, viewer rules and cancellation are the same. One
writer task per socket sends what its streams queue; a socket whose write blocks too long is
dropped by the :class:`relay.http.WriteWatchdog` (its streams keep generating and can be re-attached).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from decimal import Decimal
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from tokenpipe.errors import InvalidRequest, TokenpipeError
from tokenpipe.streams import Gap
from tokenpipe.wire import TokenBatch
from tokenpipe.wire.frames import (
    AttachedFrame,
    AttachFrame,
    AuthenticatedFrame,
    AuthFrame,
    CancelFrame,
    CancelledFrame,
    ClientFrame,
    CreatedFrame,
    CreateFrame,
    ErrorFrame,
    GapFrame,
    PingFrame,
    PongFrame,
    Ref,
    parse_client_frame,
    ref_of,
    server_frame,
)

from . import native
from .auth import Unauthorized, authorization_header
from .http import RequestTooLarge, parse_json
from .protocol import Bodies
from .sessions import Session
from .state import RelayState

__all__ = ["router", "AUTH_WAIT_S"]

log = logging.getLogger(__name__)

router = APIRouter()

AUTH_WAIT_S = 10.0  # a socket without a key (header or auth frame) is closed after this long
_OUTBOX = 256  # frames queued per socket before its streams wait for its writer
_POLICY_VIOLATION = 1008  # WebSocket close code: authentication failed or never came


def error_frame(exc: TokenpipeError, *, ref: Ref = None, stream_id: str | None = None) -> str:
    """An ``error`` frame: the HTTP error body's fields, plus the status and ``retry_after`` of a 429."""
    return ErrorFrame(ref=ref, id=stream_id, code=exc.code, message=exc.message, param=exc.param, status=exc.status,
                      retry_after=getattr(exc, "retry_after", None)).encode()


class Connection:
    """One client socket: its tenant, its streams (id → reading task) and its writer."""

    def __init__(self, state: RelayState, bodies: Bodies, ws: WebSocket) -> None:
        self.state = state
        self.bodies = bodies
        self.ws = ws
        self.tenant: str | None = None
        self.streams: dict[str, tuple[Session, asyncio.Task[None]]] = {}
        self.outbox: asyncio.Queue[str | int] = asyncio.Queue(_OUTBOX)  # frames, or a close code
        self.dropped = False
        self._writer: asyncio.Task[None] | None = None

    # -- the socket's life -------------------------------------------------------------------
    async def run(self) -> None:
        keys = self.state.keys
        await self.ws.accept()
        try:
            header = authorization_header(self.ws.scope.get("headers", []))
            if header is not None or not keys.enabled:
                self.tenant = keys.tenant_for(header)
        except Unauthorized as exc:
            await self.ws.send_text(error_frame(exc))
            await self._close_socket(_POLICY_VIOLATION)
            return
        writer = self._writer = asyncio.get_running_loop().create_task(self._write(), name="ws-writer")
        reader = asyncio.get_running_loop().create_task(self._read(), name="ws-reader")
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self._close(reader, writer)

    async def _close(self, reader: asyncio.Task[None], writer: asyncio.Task[None]) -> None:
        if self.dropped:
            log.warning("dropping slow WebSocket client: a write blocked too long",
                        extra={"streams": len(self.streams), "send_timeout_s": self.state.watchdog.timeout})
            self.state.metrics.errors.labels(kind="ws_slow_client").inc()
            for session, _ in self.streams.values():
                session.dropped()  # its streams may be re-attached
        tasks = [reader, *(task for _, task in self.streams.values()), writer]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect):
                await task  # a failure other than these is a bug: let it surface (logged by the server)
        if self.dropped:
            await self._close_socket(1013)  # "try again later"

    async def _close_socket(self, code: int) -> None:
        """Send a close frame, giving up after the slow-client timeout: a client that does not read
        cannot take it, and the server closes the connection once the handler returns anyway."""
        with contextlib.suppress(RuntimeError, OSError, TimeoutError, WebSocketDisconnect):
            async with asyncio.timeout(self.state.watchdog.timeout):
                await self.ws.close(code=code)

    def abandon(self) -> None:
        """Called by the write watchdog: this socket's write blocked too long."""
        self.dropped = True
        if self._writer is not None:
            self._writer.cancel()

    async def _write(self) -> None:
        watchdog = self.state.watchdog
        while True:
            frame = await self.outbox.get()
            if isinstance(frame, int):  # a close code: everything queued before it has been sent
                await self._close_socket(frame)
                return
            watchdog.begin(self)
            try:
                await self.ws.send_text(frame)
            finally:
                watchdog.end(self)

    async def _read(self) -> None:
        auth_deadline = asyncio.get_running_loop().time() + AUTH_WAIT_S
        while True:
            try:
                async with asyncio.timeout_at(auth_deadline if self.tenant is None else None):
                    message = await self.ws.receive()
            except TimeoutError:
                await self.outbox.put(error_frame(Unauthorized(
                    f"no API key within {AUTH_WAIT_S:g} s: send an auth frame first")))
                await self.outbox.put(_POLICY_VIOLATION)  # the writer sends what is queued, then closes
                if self._writer is not None:
                    await self._writer
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                await self.outbox.put(error_frame(InvalidRequest("frames must be JSON text, not binary")))
                continue
            await self._handle(text)

    # -- frames ------------------------------------------------------------------------------
    async def _handle(self, text: str) -> None:
        raw: Any = None
        frame: ClientFrame | None = None
        try:
            data = text.encode()  # the limit is in bytes, as an HTTP body's is
            if len(data) > self.state.settings.max_body_bytes:
                raise RequestTooLarge(self.state.settings.max_body_bytes)
            raw = parse_json(data)
            if isinstance(raw.get("speed"), float):
                # Judged on the exact decimal, as the query's speed is: the float parse already read 1e-400
                # as 0.0 ("as fast as possible"). Read again (the frame is small, a speed rare).
                raw["speed"] = json.loads(text, parse_float=Decimal)["speed"]
            frame = parse_client_frame(raw)
            if not isinstance(frame, AuthFrame) and self.tenant is None:
                raise Unauthorized('authenticate first: send {"type": "auth", "api_key": ...} '
                                   "(or connect with an Authorization header)")
            match frame:
                case AuthFrame():
                    await self._auth(frame)
                case CreateFrame():
                    await self._create(frame, self._tenant())
                case AttachFrame():
                    await self._attach(frame, self._tenant())
                case CancelFrame():
                    await self._cancel(frame, self._tenant())
                case PingFrame():
                    await self.outbox.put(PongFrame(ref=frame.ref).encode())
        except TokenpipeError as exc:
            ref = frame.ref if frame is not None else ref_of(raw)
            sid = frame.id if isinstance(frame, AttachFrame | CancelFrame) else None
            await self.outbox.put(error_frame(exc, ref=ref, stream_id=sid))

    def _tenant(self) -> str:
        assert self.tenant is not None  # _handle let only an auth frame through before it was set
        return self.tenant

    async def _auth(self, frame: AuthFrame) -> None:
        keys = self.state.keys
        if keys.enabled:
            if self.tenant is not None:
                raise InvalidRequest("this socket is already authenticated", param="api_key")
            key = (frame.api_key or "").strip()
            if not key:
                raise Unauthorized("'api_key' must be a non-empty string", param="api_key")
            self.tenant = keys.tenant_for(f"Bearer {key}")
        await self.outbox.put(AuthenticatedFrame(ref=frame.ref).encode())

    async def _create(self, frame: CreateFrame, tenant: str) -> None:
        body = self.bodies.parse_native(frame.body)
        req, session = await native.start_stream(self.state, body, tenant)  # exactly POST /v1/streams' path
        created = CreatedFrame(ref=frame.ref, id=req.id, model=req.model, service_tier=req.served_tier)
        await self.outbox.put(created.encode())
        self._follow(session, after=-1, speed=None)

    async def _attach(self, attach: AttachFrame, tenant: str) -> None:
        sid, replay = attach.id, attach.replay
        forwarder = self.state.forwarder
        meta = await forwarder.owned_meta(sid, tenant)
        if sid in self.streams:
            raise InvalidRequest(f"stream {sid!r} is already attached on this socket", param="id")
        await forwarder.check_retained(meta)
        await self.outbox.put(AttachedFrame(ref=attach.ref, id=sid).encode())
        session = Session(sid, tenant, cancel_on_exit=attach.cancel_on_disconnect and not replay, reader=not replay,
                          meta=meta)
        after = attach.after_seq if attach.after_seq is not None else -1
        self._follow(session, after=after, speed=attach.speed if replay else None)

    async def _cancel(self, frame: CancelFrame, tenant: str) -> None:
        await self.state.forwarder.cancel(frame.id, tenant)
        await self.outbox.put(CancelledFrame(ref=frame.ref, id=frame.id).encode())

    # -- streams -----------------------------------------------------------------------------
    def _follow(self, session: Session, *, after: int, speed: float | None) -> None:
        task = asyncio.get_running_loop().create_task(self._forward(session, after, speed),
                                                      name=f"ws-stream-{session.stream_id}")
        self.streams[session.stream_id] = (session, task)

    async def _forward(self, session: Session, after: int, speed: float | None) -> None:
        sid = session.stream_id
        try:
            # An idle Ping needs no frame (the socket has its own keepalive); asking for pings lets an
            # attach whose history is gone end with an error frame (Forwarder.batches).
            async for item in self.state.forwarder.batches(session, after=after, speed=speed,
                                                           idle=self.state.settings.keepalive_s):
                if isinstance(item, TokenBatch):
                    # Exactly the SSE events' data (nulls included) after type, id and seq (the SSE events' id).
                    for name, data in native.batch_events(item):
                        await self.outbox.put(server_frame({"type": name, "id": sid, "seq": item.seq, **data}).encode())
                elif isinstance(item, Gap):
                    await self.outbox.put(GapFrame(id=sid, **native.gap_event(item)).encode())
        except TokenpipeError as exc:
            await self.outbox.put(error_frame(exc, stream_id=sid))
        finally:
            if self.streams.get(sid, (None, None))[0] is session:
                del self.streams[sid]


@router.websocket("/v1/ws")
async def websocket_streams(websocket: WebSocket) -> None:
    """``/v1/ws``: see the module docstring and the README's "WebSocket" section."""
    app = websocket.app
    await Connection(app.state.relay, app.state.bodies, websocket).run()

