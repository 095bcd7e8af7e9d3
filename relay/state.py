"""What one relay process holds, from start-up to shutdown: the NATS connection, the fan-out,
the generator registry, admission and stream forwarding (see :mod:`relay.admission`,
:mod:`relay.sessions`, :mod:`relay.registry`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from tokenpipe.background import pause, stop_loops
from tokenpipe.bus import REPAIR_INTERVAL_S, Bus, connect, missing, repair
from tokenpipe.errors import NoGenerator, TokenpipeError
from tokenpipe.metrics import RelayMetrics
from tokenpipe.settings import Settings
from tokenpipe.subjects import ANNOUNCE_PREFIX, DISCOVER_SUBJECT
from tokenpipe.telemetry import get_tracer

from .admission import Admission
from .auth import KeyRing
from .batchdb import BatchDB
from .http import WriteWatchdog
from .registry import GeneratorRegistry
from .sessions import Forwarder

__all__ = ["RelayState"]

log = logging.getLogger(__name__)

_READY_CHECK_S = 2.0  # /readyz waits this long for JetStream to say whether tokenpipe's streams exist


class RelayState:
    def __init__(self, settings: Settings, tracer_provider: TracerProvider | None = None) -> None:
        self.settings = settings
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.registry = GeneratorRegistry(default_model=settings.model, wait_s=settings.generator_wait_s,
                                          discover=self._discover)
        self.keys = KeyRing.load(settings.api_keys, settings.api_keys_file)
        self.bus: Bus | None = None
        self.watchdog = WriteWatchdog(settings.slow_client_timeout_s)
        self.metrics = RelayMetrics()
        self.admission = Admission(settings, self.require_bus, self.registry.slots)
        self.forwarder = Forwarder(settings, self.tracer, self.metrics, self.admission, self.require_bus)
        self.batchdb = BatchDB(self.require_bus)  # the Batch API's files and batches (relay.files, relay.batches)
        self.missing: list[str] = []  # JetStream state tokenpipe owns that was found deleted (503 until repaired)
        self._repair_task: asyncio.Task[None] | None = None
        self._repair_now: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        if not self.keys.enabled and self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("relay listens beyond loopback without API keys: set TOKENPIPE_API_KEYS",
                        extra={"host": self.settings.host})
        self.bus = await connect(self.settings, name="tokenpipe-relay")
        self.bus.on_dropped_batch.append(lambda reason: self.metrics.dropped_batches.labels(reason).inc())
        self.bus.on_placed.append(lambda choice: self.metrics.placements.labels(
            "shared" if choice is None else choice.reason, "" if choice is None else str(choice.slot)).inc())
        await self.forwarder.start()
        nc = self.bus.nc
        await nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=self._on_announce)
        # Ask running generators to introduce themselves instead of waiting a full interval: each
        # announces at once, on the announce subject (never onto a reply subject the asker chose).
        await self._discover()
        self._repair_task = asyncio.create_task(self._repair_loop(), name="repair")

    async def _repair_loop(self) -> None:
        """Re-provision the streams and bucket when someone deleted them (``/readyz`` is 503 meanwhile)."""
        while await pause(self._stopping, REPAIR_INTERVAL_S):
            await self._repair_once()

    async def _repair_once(self) -> None:
        bus = self.bus
        if bus is None or not bus.nc.is_connected:
            return  # reconnecting: nothing to ask yet
        looks = _looks(bus)
        try:
            self.missing = await missing(bus.js, settings=self.settings, **looks)
            if self.missing:
                await repair(bus.js, self.settings, provision_streams=bus.provisions, **looks)
                self.missing = await missing(bus.js, settings=self.settings, **looks)
        except TokenpipeError as exc:  # JetStream recovering or unreachable: the next round tries again
            log.warning("JetStream check failed", extra={"error": exc.message})

    async def readiness(self) -> tuple[dict[str, Any], int]:
        """``/readyz``: 503 unless NATS is connected, tokenpipe's streams exist (looked up now; a
        missing one is re-provisioned in the background) and a generator is live; ``degraded``
        while fewer than ``expected_generators`` are."""
        connected = self.bus is not None and self.bus.nc.is_connected
        if connected and self.bus is not None:
            try:
                async with asyncio.timeout(_READY_CHECK_S):
                    self.missing = await missing(self.bus.js, settings=self.settings, **_looks(self.bus))
            except TokenpipeError as exc:
                self.missing = [exc.message]
            except TimeoutError:
                self.missing = [f"JetStream did not answer within {_READY_CHECK_S:g} s"]
            if self.missing and (self._repair_now is None or self._repair_now.done()):
                self._repair_now = asyncio.create_task(self._repair_once(), name="repair-now")
        live = self.registry.live()
        models = sorted({w.model for w in live})
        expected = self.settings.expected_generators
        ready = connected and bool(models) and not self.missing
        status = "unavailable" if not ready else "degraded" if len(live) < expected else "ready"
        body: dict[str, Any] = {"status": status, "ready": ready, "nats": connected, "models": models,
                                "generators": f"{len(live)}/{expected}" if expected else str(len(live))}
        if self.missing:
            body["missing"] = list(self.missing)
        return body, 200 if ready else 503

    async def _discover(self) -> None:
        await self.require_bus().nc.publish(DISCOVER_SUBJECT, b"")

    async def stop(self) -> None:
        # Not by cancel alone: the loop's JetStream requests can swallow one (tokenpipe.background).
        await stop_loops(self._stopping, [t for t in (self._repair_task, self._repair_now) if t is not None])
        await self.watchdog.stop()
        await self.forwarder.stop()
        if self.bus is not None:
            await self.bus.close()

    async def _on_announce(self, msg: Msg) -> None:
        self.registry.update(msg.data)

    def require_bus(self) -> Bus:
        # Reconnecting (its NATS node died) is not down: nats-py buffers what is sent meanwhile and
        # the JetStream calls retry, so a request in that window waits instead of failing.
        if self.bus is None or self.bus.nc.is_closed:
            raise NoGenerator("relay is not connected to NATS")
        return self.bus


def _looks(bus: Bus) -> dict[str, Any]:
    """How the relay looks at what tokenpipe provisions (:func:`tokenpipe.bus.missing`'s ``ask`` and
    ``relay_js``): the shared streams through the admin's answers where it may not ask JetStream
    itself, and its own account's streams in that account."""
    return {"ask": bus.nc if bus.store_questions else None, "relay_js": bus.js if bus.relay_copy else None}
