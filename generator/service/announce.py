"""How a generator makes itself known: announcements, discovery answers, and its load gauges.

Relays learn which models are served only from these (there is no static list): a generator
announces itself on ``tp.gen.announce.<worker>`` every ``announce_interval_s``, answers
``tp.gen.discover`` at once, and says it is leaving (``ready=False``) when it stops. The same
round refreshes the gauges a scrape reads (running sequences, KV-cache use, queue lag).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenpipe.background import pause, stop_loops
from tokenpipe.bus import Bus
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.subjects import ANNOUNCE_PREFIX, DISCOVER_SUBJECT, RELAY_OWNER, REQUESTS_STREAM, consumer_name
from tokenpipe.wire import Announcement

from ..engine.handle import EngineHandle, EngineStats

__all__ = ["Announcer", "KVCacheMeter"]

log = logging.getLogger(__name__)


class Announcer:
    """Announces one worker (and answers discovery) from :meth:`start` until :meth:`stop`.

    ``streams`` is the live collection of ``(owner, id)`` of the streams the worker holds (read,
    never changed). An announcement counts them all (``active``) but names only the relay's own
    (``streams``): every relay hears it, and the ids of the applications' streams named there gave
    the relay's credential a live list of every owner's running stream ids (alice's ``job-77``
    included), which its permissions keep it from listing anywhere else.
    """

    def __init__(self, bus: Bus, settings: Settings, *, worker_id: str, model: str, device: str,
                 runner: EngineHandle, streams: Callable[[], Collection[tuple[str, str]]],
                 metrics: GeneratorMetrics) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = worker_id
        self.model = model
        self.device = device
        self.runner = runner
        self.streams = streams  # (owner, id) of the streams the worker holds now
        self.metrics = metrics
        self._kv_meter = KVCacheMeter(metrics)
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._gauges: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(DISCOVER_SUBJECT, cb=self._on_discover)
        self._task = asyncio.create_task(self._run(), name="announce")
        await self.announce()

    async def stop(self) -> None:
        """Stop announcing, then say this worker is leaving (last: no round of the loop can
        announce it ready again after that)."""
        await stop_loops(self._stopping, [t for t in (self._task, self._gauges) if t is not None])
        await self.announce(ready=False)
        if self._sub is not None:
            await self._sub.unsubscribe()

    def announcement(self, ready: bool = True) -> Announcement:
        stats, held = self.runner.stats(), self.streams()
        return Announcement(
            worker=self.worker_id, model=self.model, ready=ready, max_batch=self.settings.max_batch,
            running=stats.running, active=len(held), pid=os.getpid(),
            streams=tuple(sorted(rid for owner, rid in held if owner == RELAY_OWNER)), device=self.device,
            ttl_s=self.settings.announce_interval_s * 3, ts=time.time(),
            free_blocks=stats.free_blocks, block_size=stats.block_size)

    async def announce(self, ready: bool = True) -> None:
        await self.bus.nc.publish(f"{ANNOUNCE_PREFIX}.{self.worker_id}", self.announcement(ready).encode())

    async def _on_discover(self, msg: Msg) -> None:
        """A relay asks for a round now: announced on the announce subject every relay hears, not
        onto the question's reply subject, which whoever asks chooses (with ``allow_responses`` the
        relay's credential could have had a generator publish onto any subject)."""
        if not self._stopping.is_set():
            await self.announce()

    async def _run(self) -> None:
        while await pause(self._stopping, self.settings.announce_interval_s):
            try:
                await self.announce()
            except Exception as exc:  # an outage must not end the announcements for good
                log.warning("announce failed", extra={"error": repr(exc)})
            # Off the announcements' clock: the gauges ask JetStream, which takes seconds while a
            # consumer is between leaders, and announcements that waited for it lapsed at every
            # relay (503 "no generator" with both generators alive, under a frozen cluster node).
            if self._gauges is None or self._gauges.done():
                self._gauges = asyncio.create_task(self._refresh_gauges(), name="announce-gauges")

    async def _refresh_gauges(self) -> None:
        m, stats = self.metrics, self.runner.stats()
        m.labels(m.running).set(stats.running)
        self._kv_meter.update(stats)
        try:
            info = await self.bus.js.consumer_info(REQUESTS_STREAM, consumer_name(self.model))
            m.labels(m.waiting).set(int(info.num_pending or 0))
        except Exception as exc:  # a reconnect in progress; the next round catches up
            log.debug("consumer info unavailable", extra={"error": repr(exc)})


class KVCacheMeter:
    """Moves the KV block pool's state into the generator's Prometheus metrics (its counters by how much
    the engine's totals grew since the last look), from an engine's :class:`EngineStats`."""

    def __init__(self, metrics: GeneratorMetrics) -> None:
        self.metrics = metrics
        self._seen = (0, 0, 0)

    def update(self, stats: EngineStats) -> None:
        m = self.metrics
        used, capacity, cached = stats.blocks_used, stats.blocks_capacity, stats.blocks_cached
        m.labels(m.kv_cache).set(used / max(capacity, 1))
        for state, count in (("used", used), ("cached", cached), ("free", capacity - used - cached)):
            m.kv_blocks.labels(model_name=m.model, state=state).set(count)
        now = (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.preemptions)
        for counter, new, old in zip((m.prefix_queries, m.prefix_hits, m.preemptions), now, self._seen, strict=True):
            if new > old:
                m.labels(counter).inc(new - old)
        self._seen = now
