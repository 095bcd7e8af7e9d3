"""What one relay process holds, from start-up to shutdown: the NATS connection, the fan-out,
the generator registry, admission and stream forwarding (see :mod:`relay.admission`,
:mod:`relay.forward`, :mod:`relay.registry`)."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from tokenpipe.bus import Bus, connect
from tokenpipe.errors import InvalidRequest, NoGenerator
from tokenpipe.metrics import RelayMetrics
from tokenpipe.settings import Settings
from tokenpipe.subjects import ANNOUNCE_PREFIX, DISCOVER_SUBJECT
from tokenpipe.telemetry import get_tracer

from .admission import Admission
from .auth import KeyRing
from .fanout import Fanout
from .forward import Forwarder
from .http import WriteWatchdog
from .registry import GeneratorRegistry

__all__ = ["RelayState"]

log = logging.getLogger(__name__)


class RelayState:
    def __init__(self, settings: Settings, tracer_provider: TracerProvider | None = None) -> None:
        self.settings = settings
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.registry = GeneratorRegistry(default_model=settings.model, wait_s=settings.generator_wait_s,
                                          discover=self._discover)
        self.keys = KeyRing.load(settings.api_keys, settings.api_keys_file)
        self.bus: Bus | None = None
        self.fanout: Fanout | None = None
        self.watchdog = WriteWatchdog(settings.slow_client_timeout_s)
        if settings.relay_fanout not in ("shared", "consumer"):
            raise InvalidRequest(f"relay_fanout must be 'shared' or 'consumer', not {settings.relay_fanout!r}",
                                 param="relay_fanout")
        self.metrics = RelayMetrics()
        self.admission = Admission(settings, self.require_bus)
        self.forwarder = Forwarder(settings, self.tracer, self.metrics, self.admission, self.require_bus)
        self._discover_inbox = ""

    async def start(self) -> None:
        if not self.keys.enabled and self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("relay listens beyond loopback without API keys: set TOKENPIPE_API_KEYS",
                        extra={"host": self.settings.host})
        self.bus = await connect(self.settings, name="tokenpipe-relay")
        if self.settings.relay_fanout == "shared":
            self.fanout = Fanout(self.bus)
            await self.fanout.start()
            self.forwarder.fanout = self.fanout
        await self.forwarder.start()
        nc = self.bus.nc
        await nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=self._on_announce)
        # Ask running generators to introduce themselves instead of waiting a full interval.
        self._discover_inbox = nc.new_inbox()
        await nc.subscribe(self._discover_inbox, cb=self._on_announce)
        await self._discover()

    async def _discover(self) -> None:
        await self.require_bus().nc.publish(DISCOVER_SUBJECT, b"", reply=self._discover_inbox)

    async def stop(self) -> None:
        await self.watchdog.stop()
        await self.forwarder.stop()
        if self.fanout is not None:
            await self.fanout.stop()
        if self.bus is not None:
            await self.bus.close()

    async def _on_announce(self, msg: Any) -> None:
        self.registry.update(msg.data)

    def require_bus(self) -> Bus:
        if self.bus is None or not self.bus.nc.is_connected:
            raise NoGenerator("relay is not connected to NATS")
        return self.bus
