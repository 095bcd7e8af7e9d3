"""Server-Sent Events framing. Pure functions over str/bytes; knows nothing of NATS."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["sse_event", "sse_comment", "SSE_HEADERS"]

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
    "Connection": "keep-alive",
}


def sse_event(data: Any, *, event: str | None = None, id: str | int | None = None) -> bytes:
    """One event. ``data`` that is not a str is JSON-encoded (compact, UTF-8: orjson, which is
    several times cheaper than ``json`` on this per-event path); multi-line data is split per the spec."""
    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = b""
    if id is not None:
        head += b"id: " + str(id).encode() + b"\n"
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    return head + b"data: " + body.replace(b"\n", b"\ndata: ") + b"\n\n"


def sse_comment() -> bytes:
    return b": ping\n\n"
