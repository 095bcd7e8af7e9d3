"""The relay's ``/v1/ws`` from Python: one WebSocket carrying many streams (the ``websockets`` library).

    async with RelaySocket("http://127.0.0.1:8000") as sock:
        a = await sock.create(prompt="Hi", max_tokens=32)
        b = await sock.create(prompt="Hello", max_tokens=32)
        async for event in sock.events(a):        # the same SSEEvent objects as over SSE
            ...

Usually reached through ``RelayClient(url, transport="websocket")``, which keeps its SSE API.
A stream created on the socket is followed at once (its frames are queued until read);
``events`` of any other stream attaches to it. Errors raise the :mod:`tokenpipe.errors` family,
as :class:`producer.RelayClient` does.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from tokenpipe.errors import InvalidRequest, Overloaded, TokenpipeError, TransportError, error_class
from tokenpipe.wire.frames import (
    AttachedFrame,
    ClientFrame,
    CreatedFrame,
    ErrorFrame,
    ServerFrame,
    StreamFrame,
    parse_client_frame,
    parse_server_frame,
)

from .sse import SSEEvent

__all__ = ["RelaySocket", "relay_error"]


def relay_error(message: str, code: str | None, param: str | None, *, status: int,
                retry_after: str | int) -> TokenpipeError:
    """A relay's error (an HTTP error body, or an ``error`` frame) as the exception its ``code`` names:
    the relay sends the class's own ``code`` slug; without one, ``status`` picks the class."""
    cls = error_class(code or "")
    if cls is not None and issubclass(cls, Overloaded):  # Overloaded, RateLimited: with when to retry
        return cls(message, retry_after=int(retry_after), param=param)
    cls = cls or (InvalidRequest if 400 <= status < 500 else TokenpipeError)
    return cls(message, param=param)


def _event(frame: ServerFrame) -> SSEEvent:
    """A stream frame as the SSE event it mirrors: same name, same data, ``id`` the batch's seq."""
    name, data, seq = frame.event()
    return SSEEvent(name, orjson.dumps(data).decode(), seq)


class RelaySocket:
    """One ``/v1/ws`` connection; ``url`` is the relay's base URL (http:// or ws://)."""

    def __init__(self, url: str, *, api_key: str | None = None, open_timeout: float = 30.0) -> None:
        base = url.rstrip("/")
        if base.startswith(("http://", "https://")):
            base = "ws" + base[len("http"):]  # http(s):// -> ws(s)://
        self.url = base + "/v1/ws"
        self.api_key = api_key
        self.open_timeout = open_timeout
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._refs = itertools.count(1)
        self._pending: dict[int, asyncio.Future[ServerFrame]] = {}
        self._streams: dict[str, asyncio.Queue[StreamFrame | ErrorFrame | None]] = {}
        self._closed: TransportError | None = None

    async def __aenter__(self) -> RelaySocket:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await connect(self.url, additional_headers=headers, open_timeout=self.open_timeout,
                                     max_size=None)
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise TransportError(f"could not open {self.url}: {exc!r}") from exc
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="relay-socket-reader")

    async def aclose(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await self._reader

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for message in self._ws:
                frame = parse_server_frame(message)
                if frame is not None:  # else a frame of a newer relay's, which this side has no use for
                    self._dispatch(frame)
            self._closed = TransportError(f"the relay closed the socket ({self._ws.close_code})")
        except WebSocketException as exc:
            self._closed = TransportError(f"the socket to the relay failed: {exc!r}")
        finally:
            closed = self._closed or TransportError("the socket to the relay was closed")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(closed)
            for queue in self._streams.values():
                queue.put_nowait(None)  # the socket went away

    def _dispatch(self, frame: ServerFrame) -> None:
        if isinstance(frame, CreatedFrame | AttachedFrame):
            self._streams.setdefault(frame.id, asyncio.Queue())  # before any of its frames is read
        ref = getattr(frame, "ref", None)
        future = self._pending.pop(ref, None) if isinstance(ref, int) else None
        if future is not None:
            if not future.done():
                future.set_result(frame)
            return
        queue = self._streams.get(getattr(frame, "id", None) or "")
        if queue is not None and isinstance(frame, StreamFrame | ErrorFrame):
            queue.put_nowait(frame)

    async def _request(self, frame: ClientFrame) -> ServerFrame:
        if self._ws is None:
            await self.connect()
        assert self._ws is not None
        if self._closed is not None:
            raise self._closed
        ref = next(self._refs)
        future: asyncio.Future[ServerFrame] = asyncio.get_running_loop().create_future()
        self._pending[ref] = future
        try:
            await self._ws.send(frame.model_copy(update={"ref": ref}).encode())
        except WebSocketException as exc:
            self._pending.pop(ref, None)
            raise TransportError(f"could not send to the relay: {exc!r}") from exc
        reply = await future
        if isinstance(reply, ErrorFrame):
            raise relay_error(reply.message, reply.code, reply.param, status=reply.status,
                              retry_after=reply.retry_after or 1)
        return reply

    async def create(self, body: Mapping[str, Any] | None = None, **fields: Any) -> str:
        """A ``create`` frame (the native POST body); returns the new stream's id. Its events are
        queued from now on: read them with :meth:`events`."""
        reply = await self._request(parse_client_frame({**(body or {}), **fields, "type": "create"}))
        assert isinstance(reply, CreatedFrame), reply
        return reply.id

    async def events(self, stream_id: str, *, after_seq: int | None = None, replay: bool = False,
                     speed: float | None = None) -> AsyncIterator[SSEEvent]:
        """The stream's events (``tokens``, ``gap``, then ``done`` or ``error``), as :class:`SSEEvent`
        objects carrying the same data as the SSE route's, after batch ``after_seq`` when given. A
        stream not created on this socket (or already read to its end, or a replay) is attached first."""
        if stream_id not in self._streams or replay:
            attach = {"type": "attach", "id": stream_id, "replay": replay, "after_seq": after_seq, "speed": speed}
            await self._request(parse_client_frame({k: v for k, v in attach.items() if v is not None}))
        queue = self._streams[stream_id]
        try:
            while True:
                frame_or_end = await queue.get()
                if frame_or_end is None:
                    raise self._closed or TransportError(f"the stream {stream_id} ended before its final event")
                seq = getattr(frame_or_end, "seq", None)
                if after_seq is not None and isinstance(seq, int) and seq <= after_seq and not replay:
                    continue  # followed since it was created here: what the caller has seen is skipped here
                event = _event(frame_or_end)
                yield event
                if event.event in ("done", "error"):
                    return
        finally:
            if self._streams.get(stream_id) is queue:
                del self._streams[stream_id]

    async def cancel(self, stream_id: str) -> None:
        """A ``cancel`` frame (the owner's ``DELETE``): the stream then ends with ``cancelled``."""
        await self._request(parse_client_frame({"type": "cancel", "id": stream_id}))
