"""A minimal HTTP/1.1 client on asyncio streams, for measuring latency without a client library.

httpx adds ~0.6 ms to a POST here, and its CPU competes with the engine and the relay on the
same cores, so the TTFT probe, the concurrent phase and the fan-out benchmark read the relay
with this instead. It speaks just enough HTTP for the relay: a JSON POST with Content-Length,
and a streamed response (chunked or not) whose body goes to the one SSE parser,
:class:`producer.SSEParser`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from producer import SSEEvent, SSEParser
from tokenpipe_cli.loadgen import Record, record_event

__all__ = ["Dechunker", "SSEResponse", "get_request", "raw_stream"]


class Dechunker:
    """Incremental decoder of a ``Transfer-Encoding: chunked`` body: feed raw bytes, get body bytes."""

    __slots__ = ("_left", "_rest", "_skip", "done")

    def __init__(self) -> None:
        self._rest = b""  # an incomplete chunk-size line
        self._left = 0  # bytes of the current chunk still to come
        self._skip = 0  # bytes of the CRLF after a chunk still to skip
        self.done = False  # the last (empty) chunk arrived

    def feed(self, data: bytes) -> bytes:
        buf = self._rest + data if self._rest else data
        out = []
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self._left:
                take = min(self._left, n - i)
                out.append(buf[i:i + take])
                i += take
                self._left -= take
                if not self._left:
                    self._skip = 2
            elif self._skip:
                take = min(self._skip, n - i)
                i += take
                self._skip -= take
            else:
                eol = buf.find(b"\r\n", i)
                if eol < 0:
                    break
                self._left = int(buf[i:eol].split(b";", 1)[0], 16)  # chunk extensions are ignored
                self.done = self._left == 0
                i = eol + 2
        self._rest = b"" if self.done else buf[i:]
        return b"".join(out)


class SSEResponse:
    """One streamed HTTP/1.1 response, fed the bytes as they arrive: its status, then its events."""

    __slots__ = ("_dechunk", "_head", "parser", "status")

    def __init__(self) -> None:
        self.status: int | None = None  # known once the whole head has arrived
        self._head = b""
        self._dechunk: Dechunker | None = None
        self.parser = SSEParser()

    @property
    def ended(self) -> bool:
        """The chunked body's last chunk arrived (a close-delimited body ends with the connection)."""
        return self._dechunk is not None and self._dechunk.done

    def feed(self, data: bytes) -> list[SSEEvent]:
        if self.status is None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return []
            head, data = self._head[:end], self._head[end + 4:]
            self._head = b""
            self.status = int(head.split(b" ", 2)[1])
            if b"transfer-encoding: chunked" in head.lower():
                self._dechunk = Dechunker()
        return self.parser.feed(self._dechunk.feed(data) if self._dechunk is not None else data)


def get_request(path: str, api_key: str = "") -> bytes:
    """The bytes of ``GET path`` asking for an event stream (with ``api_key`` as a bearer token)."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return f"GET {path} HTTP/1.1\r\nHost: bench\r\n{auth}Accept: text/event-stream\r\n\r\n".encode()


async def raw_stream(url: str, body: dict[str, Any], api_key: str = "") -> Record:
    """One request over the native API, timed from the POST, like the load generator's
    :func:`tokenpipe_cli.loadgen.native_stream` but without a client library."""
    host, port = url.removeprefix("http://").split(":")
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    rec = Record(ok=False, start=time.perf_counter())
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/streams HTTP/1.1\r\nHost: bench\r\n%sContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (auth, len(payload), payload))
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        sid = json.loads(await reader.readexactly(length))["id"]
        writer.write(get_request(f"/v1/streams/{sid}", api_key))
        response = SSEResponse()
        ended = False
        while not ended:
            data = await reader.read(65536)
            if not data:
                break  # connection closed before the end of the stream
            for event in response.feed(data):
                ended = record_event(rec, event) or ended
    finally:
        writer.close()
    rec.e2e = time.perf_counter() - rec.start
    rec.ok = rec.finish in ("length", "stop")
    return rec
