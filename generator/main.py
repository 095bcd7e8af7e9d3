"""Process entry point for one generator worker."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from functools import partial
from pathlib import Path

import torch

from tokenpipe.bus import connect
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.telemetry import setup_tracing

from .health import StatusServer
from .models import LoadedModel, load_model, resolve_threads
from .runner import torch_thread
from .worker import GeneratorWorker

__all__ = ["serve"]

log = logging.getLogger(__name__)


def _load(settings: Settings) -> LoadedModel:
    torch.set_num_threads(resolve_threads(settings.threads))  # OpenMP's thread count is per calling thread
    return load_model(settings.model, path=settings.model_path, device=settings.device, dtype=settings.dtype,
                      data_dir=settings.data_dir, quant=settings.quant, kernels=settings.kernels,
                      max_batch=settings.max_batch)


async def serve(settings: Settings) -> None:
    """Load the model, connect, serve until SIGINT/SIGTERM, then drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    status: StatusServer | None = None
    if settings.metrics_port > 0:
        try:  # before the model loads: liveness holds while it does, readiness waits for the worker
            status = StatusServer(settings.metrics_host, settings.metrics_port).start()
            log.info("/metrics, /healthz, /readyz served", extra={"port": settings.metrics_port})
        except OSError as exc:  # another generator on this host holds the port: serve, just without metrics
            log.warning("metrics port unavailable; metrics and probes disabled",
                        extra={"port": settings.metrics_port, "error": str(exc)})
    engine_thread = torch_thread()
    loaded = await loop.run_in_executor(engine_thread, partial(_load, settings))
    provider = setup_tracing("tokenpipe-generator")
    bus = await connect(settings, name=f"tokenpipe-generator-{loaded.name}", role="generator")
    metrics = GeneratorMetrics(loaded.name)
    worker = GeneratorWorker(settings, loaded, bus, tracer_provider=provider, metrics=metrics,
                             torch_thread=engine_thread)
    if status is not None:
        status.registry, status.worker = metrics.registry, worker
    await worker.start()
    ready = Path(settings.ready_file) if settings.ready_file else None
    if ready is not None:  # `tokenpipe up` reads it: this process serves
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.replace(ready)
    await stop.wait()
    if ready is not None:
        ready.unlink(missing_ok=True)
    log.info("shutting down: draining", extra={"active": len(worker.active)})
    await worker.stop(drain_timeout=settings.drain_timeout_s)
    await bus.close()
    if status is not None:
        status.stop()
    engine_thread.shutdown(wait=False)
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
