"""Process entry point for the relay."""

from __future__ import annotations

import uvicorn
from opentelemetry.trace import TracerProvider

from tokenpipe.settings import Settings
from tokenpipe.telemetry import setup_tracing

from .app import create_app

__all__ = ["serve", "uvicorn_config"]


def uvicorn_config(settings: Settings, provider: TracerProvider, **kw: object) -> uvicorn.Config:
    app = create_app(settings, tracer_provider=provider)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                          timeout_graceful_shutdown=3, **kw)  # type: ignore[arg-type]


async def serve(settings: Settings) -> None:
    provider = setup_tracing("tokenpipe-relay")
    try:
        await uvicorn.Server(uvicorn_config(settings, provider)).serve()
    finally:
        shutdown = getattr(provider, "shutdown", None)
        if shutdown is not None:
            shutdown()  # flush spans still batched for export
