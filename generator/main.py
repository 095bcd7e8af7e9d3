"""Process entry point for one generator worker: the model loaded (here, or in the engine-core process), the
worker serving it from NATS, the status listener, the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from functools import partial
from pathlib import Path

import torch

from tokenpipe.bus import connect
from tokenpipe.errors import GenerationError, TransportError
from tokenpipe.settings import Settings
from tokenpipe.telemetry import setup_tracing

from .engine.graphs import resolve_cuda_graphs
from .engine.process import EngineProcess, use_engine_process
from .engine.runner import torch_thread
from .model.loader import LoadedModel, load_for, resolve_device
from .service.health import StatusServer
from .service.worker import GeneratorWorker

__all__ = ["serve"]

log = logging.getLogger(__name__)


async def _gate_opens(gate: Path, stop: asyncio.Event, timeout_s: float = 600.0) -> bool:
    """Wait for ``gate`` (``TOKENPIPE_START_GATE``) to exist: True once it does, False if stopped first."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    if not gate.exists():
        log.info("model loaded; waiting for the streams to exist before connecting", extra={"gate": str(gate)})
    while not gate.exists():
        if stop.is_set():
            return False
        if asyncio.get_running_loop().time() > deadline:
            raise TransportError(f"{gate} did not appear within {timeout_s:g} s: the streams were never set up")
        await asyncio.sleep(0.05)  # a file the supervisor writes: polled
    return True


async def serve(settings: Settings) -> None:
    """Load the model, connect, serve until SIGINT/SIGTERM, then drain."""
    resolve_cuda_graphs(settings.cuda_graphs, resolve_device(settings.device))  # refused before anything loads
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    status: StatusServer | None = None
    if settings.metrics_port > 0:
        # Before the model loads: liveness holds while it does, readiness waits for the worker. A port another
        # process took (two `tokenpipe up` on one host: each checks its ports free, its generators bind them
        # seconds later) gives way to a free one, named in the log and in the ready file `up` reads.
        for port in (settings.metrics_port, 0):
            try:
                status = StatusServer(settings.metrics_host, port).start()
            except OSError as exc:
                log.warning("metrics port unavailable", extra={"port": port or "any", "error": str(exc)})
                continue
            log.info("/metrics, /healthz, /readyz served", extra={"port": status.port})
            break
    engine_thread = torch_thread()
    engine: EngineProcess | None = None
    engine_died: list[int | None] = []
    if use_engine_process(settings.engine_process, settings.device):
        def died(code: int | None) -> None:  # on the engine reader thread
            engine_died.append(code)
            loop.call_soon_threadsafe(stop.set)

        engine = EngineProcess(settings, on_exit=died)
        info = await asyncio.to_thread(engine.load)
        # This process holds no weights: its LoadedModel only names the model and its device.
        loaded = LoadedModel(info["name"], None, None, frozenset(), torch.device(info["device"]),
                             getattr(torch, info["dtype"].removeprefix("torch.")))
    else:
        loaded = await loop.run_in_executor(engine_thread, partial(load_for, settings))
    if settings.start_gate and not await _gate_opens(Path(settings.start_gate), stop):
        return  # stopped while waiting: nothing was connected
    provider = setup_tracing("tokenpipe-generator")
    bus = await connect(settings, name=f"tokenpipe-generator-{loaded.name}", role="generator")
    worker = GeneratorWorker(settings, loaded, bus, tracer_provider=provider, torch_thread=engine_thread,
                             engine_process=engine)
    if status is not None:
        status.registry, status.worker = worker.metrics.registry, worker
    await worker.start()
    ready = Path(settings.ready_file) if settings.ready_file else None
    if ready is not None:  # `tokenpipe up` reads it: this process serves
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(f"{os.getpid()} {status.port if status is not None else 0}")  # pid, metrics port
        tmp.replace(ready)
    await stop.wait()
    if ready is not None:
        ready.unlink(missing_ok=True)
    log.info("shutting down: draining", extra={"active": len(worker.active)})
    # A dead engine finishes nothing: its requests go back to JetStream at once, for another worker.
    await worker.stop(drain_timeout=0 if engine_died else settings.drain_timeout_s)
    await bus.close()
    if status is not None:
        status.stop()
    engine_thread.shutdown(wait=False)
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
    if engine_died:  # the supervisor restarts this generator, and with it the engine
        raise GenerationError(f"the engine-core process died (exit {engine_died[0]}); its requests were handed back")
