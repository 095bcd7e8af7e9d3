"""The generator's HTTP status listener: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

Kubernetes probes these (deploy/helm): ``/healthz`` answers 200 while the process's event loop
turns (it beats once a second; a loop stuck for ``stall_s`` is unhealthy, so the pod is
restarted), from the start, model loading included; ``/readyz`` answers 200 only once the worker
serves (model loaded, NATS connected, pulling) and 503 again while it drains. The listener runs
on its own thread, as prometheus_client's does, so a busy loop cannot delay a scrape.
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["StatusServer", "HEALTH_PATHS"]

HEALTH_PATHS = ("/metrics", "/healthz", "/readyz")


class _Serving(Protocol):
    @property
    def serving(self) -> bool: ...


class StatusServer:
    """Serves the three routes on ``host:port`` from :meth:`start` until :meth:`stop`."""

    def __init__(self, host: str, port: int, *, stall_s: float = 10.0) -> None:
        self.host, self.port, self.stall_s = host, port, stall_s
        self.registry: CollectorRegistry | None = None  # set once the model (and its metrics) exist
        self.worker: _Serving | None = None
        self._beat = time.monotonic()
        self._httpd: ThreadingHTTPServer | None = None
        self._beater: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> StatusServer:
        status = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server names it
                code, body, ctype = status.answer(self.path.split("?", 1)[0])
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # probes every few seconds would flood the log

        httpd = self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        httpd.daemon_threads = True
        httpd.timeout = 0.2
        self.port = httpd.server_address[1]
        # Not serve_forever(): a shutdown() that comes before serve_forever() starts is lost, and hangs.
        self._thread = threading.Thread(target=self._serve, args=(httpd,), name="status-http", daemon=True)
        self._thread.start()
        self._beater = asyncio.get_running_loop().create_task(self._beat_loop(), name="status-beat")
        return self

    def _serve(self, httpd: ThreadingHTTPServer) -> None:
        while not self._closed.is_set():
            httpd.handle_request()

    async def _beat_loop(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(1.0)

    def answer(self, path: str) -> tuple[int, bytes, str]:
        """``(status, body, content type)`` for ``path``."""
        text = "text/plain; charset=utf-8"
        if path == "/healthz":
            stalled = time.monotonic() - self._beat
            if stalled > self.stall_s:
                return 503, f"event loop stalled for {stalled:.0f} s\n".encode(), text
            return 200, b"ok\n", text
        if path == "/readyz":
            if self.worker is not None and self.worker.serving:
                return 200, b"ready\n", text
            return 503, b"not serving (loading the model, connecting, or draining)\n", text
        if path == "/metrics":
            if self.registry is None:
                return 503, b"metrics start once the model is loaded\n", text
            return 200, generate_latest(self.registry), CONTENT_TYPE_LATEST
        return 404, b"not found\n", text

    def stop(self) -> None:
        if self._beater is not None:
            self._beater.cancel()
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        if self._httpd is not None:
            self._httpd.server_close()
            self._httpd = None
