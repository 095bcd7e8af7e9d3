"""Process entry point for one generator worker."""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial

import torch
from prometheus_client import start_http_server

from tokenpipe.bus import connect
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.telemetry import setup_tracing

from .models import LoadedModel, load_model, resolve_threads
from .runner import torch_thread
from .worker import GeneratorWorker

__all__ = ["serve"]

log = logging.getLogger(__name__)


def _load(settings: Settings) -> LoadedModel:
    torch.set_num_threads(resolve_threads(settings.threads))  # OpenMP's thread count is per calling thread
    return load_model(settings.model, path=settings.model_path, device=settings.device, dtype=settings.dtype,
                      data_dir=settings.data_dir, quant=settings.quant)


async def serve(settings: Settings) -> None:
    """Load the model, connect, serve until SIGINT/SIGTERM, then drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine_thread = torch_thread()
    loaded = await loop.run_in_executor(engine_thread, partial(_load, settings))
    provider = setup_tracing("tokenpipe-generator")
    bus = await connect(settings, name=f"tokenpipe-generator-{loaded.name}")
    metrics = GeneratorMetrics(loaded.name)
    if settings.metrics_port > 0:
        try:
            start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
            log.info("metrics at /metrics", extra={"port": settings.metrics_port})
        except OSError as exc:  # another generator on this host holds the port: serve, just without metrics
            log.warning("metrics port unavailable; metrics disabled",
                        extra={"port": settings.metrics_port, "error": str(exc)})
    worker = GeneratorWorker(settings, loaded, bus, tracer_provider=provider, metrics=metrics,
                             torch_thread=engine_thread)
    await worker.start()
    await stop.wait()
    log.info("shutting down: draining", extra={"active": len(worker.active)})
    await worker.stop(drain_timeout=settings.drain_timeout_s)
    await bus.close()
    engine_thread.shutdown(wait=False)
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
