"""tokenpipe relay: the HTTP/SSE edge in front of NATS."""

from .app import create_app

__all__ = ["create_app"]
