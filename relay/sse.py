"""Server-Sent Events framing. Pure functions over str/bytes; knows nothing of NATS."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["sse_event", "sse_comment", "SSE_HEADERS"]

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
    "Connection": "keep-alive",
}


def sse_event(data: Any, *, event: str | None = None, id: str | int | None = None) -> bytes:
    """One event. ``data`` that is not a str is JSON-encoded; multi-line data is split per the spec."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in text.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


def sse_comment(text: str = "ping") -> bytes:
    return f": {text}\n\n".encode()
