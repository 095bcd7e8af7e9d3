"""Client-side Server-Sent Events: an incremental parser, pure (no I/O, no HTTP library).

    parser = SSEParser()
    for chunk in chunks:                 # bytes, split anywhere
        for event in parser.feed(chunk):
            print(event.event, event.id, event.json())

It follows the WHATWG event-stream rules that matter to a client of the relay: lines end in
LF, CRLF or CR (a chunk may end between the CR and the LF), ``data:`` lines of one event are
joined with LF, one space after the colon is dropped, comments (``: ping``) and events
without data are not dispatched, ``retry:`` is kept. Bytes are split into lines before they
are decoded, so a UTF-8 character split across two chunks is decoded whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

__all__ = ["SSEEvent", "SSEParser"]


class SSEEvent(NamedTuple):
    """One dispatched event. ``id`` is this event's own ``id:`` field (None when it had none);
    the id to resume from is :attr:`SSEParser.last_event_id`."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        """``data`` decoded as JSON (every event of the relay's native API carries JSON)."""
        return orjson.loads(self.data)


class SSEParser:
    """Feed bytes (:meth:`feed`) or already split lines (:meth:`feed_line`); get whole events."""

    __slots__ = ("_data", "_event", "_id", "_rest", "_skip_lf", "last_event_id", "retry_ms")

    def __init__(self) -> None:
        self._rest = b""  # an unterminated line, kept until its end arrives
        self._skip_lf = False  # the previous chunk ended in CR: an LF starting this one is its CRLF
        self._event = ""
        self._id: str | None = None
        self._data: list[str] = []
        self.last_event_id: str | None = None  # sticky across events, as a browser's EventSource keeps it
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events completed by ``chunk`` (possibly none)."""
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._rest + chunk if self._rest else chunk
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._rest = buf.split(b"\n")
        return [event for event in map(self._line, lines) if event is not None]

    def feed_line(self, line: str) -> SSEEvent | None:
        """One line without its terminator (as ``httpx.Response.aiter_lines`` yields them);
        returns the event that a blank line completes."""
        return self._line(line.encode())

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        name, _, value = line.partition(b":")
        if not name:
            return None  # a comment: the relay's keep-alive
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode())
        elif name == b"event":
            self._event = value.decode()
        elif name == b"id":
            if b"\0" not in value:
                self._id = self.last_event_id = value.decode()
        elif name == b"retry" and value.isdigit():
            self.retry_ms = int(value)
        return None  # unknown fields are ignored, per the spec

    def _dispatch(self) -> SSEEvent | None:
        data, event, eid = self._data, self._event, self._id
        self._data, self._event, self._id = [], "", None
        if not data:
            return None
        return SSEEvent(event or "message", "\n".join(data), eid)
