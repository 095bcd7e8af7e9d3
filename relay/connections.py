"""The relay's HTTP connections as uvicorn serves them, made fit for an exposed edge.

uvicorn closes a keep-alive connection that stays idle between requests (``timeout_keep_alive``)
but gives a new connection, or one that sent half a request's headers, all the time it wants:
an exposed relay could be exhausted by connections that never finish a request (slowloris).
Here every request's headers must be complete within ``header_timeout_s`` of the connection
opening (or of the previous response), or the connection gets a 408 and is closed. A request
uvicorn cannot parse gets the relay's JSON error body (400), not uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenpipe.settings import Settings

from .http import error_body

__all__ = ["server_options"]

IDLE_TIMEOUT_S = 5  # uvicorn's keep-alive idle timeout, stated rather than inherited


def _raw_response(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = orjson.dumps(error_body(message, status=status, code=code))
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


class _EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and JSON parse errors."""

    header_timeout_s: float  # the relay's setting: server_options makes a subclass per relay

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a request is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a keep-alive connection

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_raw_response(408, b"Request Timeout",
                                               f"request headers not received within {self.header_timeout_s:g} s",
                                               "request_timeout"))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(_raw_response(400, b"Bad Request", f"malformed HTTP request: {msg}", "invalid_request"))
        self.transport.close()


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn options every relay server runs with (``relay.main`` and the tests' relays alike)."""
    edge = type("EdgeHttpProtocol", (_EdgeProtocol,), {"header_timeout_s": settings.header_timeout_s})
    return {"http": edge, "timeout_keep_alive": IDLE_TIMEOUT_S,
            # WebSocket keepalive: a protocol ping every keepalive_s; no pong within the slow-client
            # timeout closes the socket (a browser answers pings by itself)
            "ws_ping_interval": settings.keepalive_s, "ws_ping_timeout": settings.slow_client_timeout_s}
