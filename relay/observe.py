"""The relay's SERVER span and request counter, as a small pure-ASGI middleware.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched; the span is current while the route runs, so the PRODUCER span of a
submission and the forwarding span of a stream become its children.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenpipe.metrics import RelayMetrics
from tokenpipe.telemetry import extract_context

__all__ = ["ObserveMiddleware", "route_of"]

_UNTRACED = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


def route_of(path: str) -> str:
    """A low-cardinality route label (stream ids never become label values)."""
    if path.startswith("/v1/streams/"):
        return "/v1/streams/{id}"
    if path in ("/", "/health", "/healthz", "/readyz", "/metrics", "/v1/models", "/v1/streams", "/v1/chat/completions",
                "/v1/completions"):
        return path
    return "other"


class ObserveMiddleware:
    def __init__(self, app: ASGIApp, tracer: Tracer, metrics: RelayMetrics) -> None:
        self.app = app
        self.tracer = tracer
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(scope["path"])
        if route in _UNTRACED:
            await self.app(scope, receive, send)  # probes and scrapes: every few seconds, never interesting
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        attrs: dict[str, Any] = {"http.request.method": scope["method"], "url.path": scope["path"],
                                 "http.route": route}
        with self.tracer.start_as_current_span(f"{scope['method']} {route}", context=extract_context(headers),
                                               kind=SpanKind.SERVER, attributes=attrs) as span:
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                span.set_attribute("http.response.status_code", status["code"])
                if status["code"] >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
                self.metrics.requests.labels(route=route, status=str(status["code"])).inc()
                if status["code"] >= 400:
                    self.metrics.errors.labels(kind=f"http_{status['code']}").inc()

