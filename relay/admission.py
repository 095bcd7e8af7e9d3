"""Admission control at the edge: unfinished streams per API key, and the depth of a model's queue.

Generators take work only when they have room (pull = admission control), so a saturated
fleet shows up as consumer lag; the relay answers 429 instead of letting that queue grow
without bound, and keeps one key from holding every slot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from tokenpipe.bus import Bus
from tokenpipe.errors import Overloaded, TokenpipeError
from tokenpipe.quota import TokenRate
from tokenpipe.settings import Settings
from tokenpipe.streams import last_batch
from tokenpipe.subjects import REQUESTS_STREAM, consumer_name

__all__ = ["Admission"]

log = logging.getLogger(__name__)

_QUEUE_INFO_TTL = 0.25  # seconds a consumer-lag reading is reused for admission decisions
_QUEUE_INFO_TIMEOUT = 0.5  # ... and how long one reading may take before it counts as unavailable


class Admission:
    """Stream slots per tenant (``max_streams_per_key``, shared by all of a tenant's keys), the
    queue-depth check (``max_queue_depth``) and each tenant's tokens per minute
    (``owner_tokens_per_min``, :class:`tokenpipe.quota.TokenRate`)."""

    def __init__(self, settings: Settings, bus: Callable[[], Bus], slots: Callable[[str], int] = lambda _: 0) -> None:
        self.settings = settings
        self._bus = bus
        self._slots = slots  # a model's generators' slots together (relay.registry.GeneratorRegistry.slots)
        self.open_streams: dict[str, dict[str, float]] = {}  # tenant -> {stream id: reservation expiry}
        self._queue_info: dict[str, tuple[float, int]] = {}
        self.token_rate = TokenRate(settings.owner_tokens_per_min)

    async def admit(self, tenant: str, model: str, stream_id: str, cost: int = 0) -> None:
        """Reserve a stream slot for ``tenant`` and charge ``cost`` tokens to its tokens per minute;
        429 when the tenant (all its keys together) has too many unfinished streams, the model's queue
        is too deep, or its tokens per minute are spent (:class:`~tokenpipe.errors.RateLimited`). The
        slot is freed when a reader sees the stream end, when its owner cancels it, or
        ``unread_stream_release_s`` after it was created or its last reader here left (a stream
        nobody reads); while a reader is attached it is held. A stream that finished while nobody
        here read it is found (its final batch in JetStream) when the tenant reaches its limit, and
        freed then."""
        mine = self.open_streams.setdefault(tenant, {})
        self._forget_lapsed(mine)
        if len(mine) >= self.settings.max_streams_per_key:
            await self._forget_finished(mine)
            self._forget_lapsed(mine)
        if len(mine) >= self.settings.max_streams_per_key:
            raise Overloaded(f"too many unfinished streams for this tenant (limit {self.settings.max_streams_per_key}, "
                             "shared by all its keys)")
        # No await between the last check and this: no race.
        mine[stream_id] = time.monotonic() + self.settings.unread_stream_release_s
        try:
            depth = await self.queue_depth(model)
            if depth > self.settings.max_queue_depth:
                raise Overloaded(f"{depth} requests are already waiting for {model!r}; retry shortly",
                                 retry_after=2)
            self.token_rate.charge(tenant, cost)  # last: a request refused otherwise is not charged
        except BaseException:
            self.release(tenant, stream_id)
            raise

    @staticmethod
    def _forget_lapsed(mine: dict[str, float]) -> None:
        now = time.monotonic()
        for sid in [k for k, expiry in mine.items() if expiry < now]:
            del mine[sid]

    async def _forget_finished(self, mine: dict[str, float]) -> None:
        """Free the slots of streams that finished while no reader here was attached (nobody here
        saw their final batch): asked of JetStream only when a tenant is at its limit."""
        unread = [sid for sid, expiry in mine.items() if expiry != math.inf]
        finished = await asyncio.gather(*(self._finished(sid) for sid in unread))
        for sid, done in zip(unread, finished, strict=True):
            if done:
                mine.pop(sid, None)

    async def _finished(self, stream_id: str) -> bool:
        try:
            last = await last_batch(self._bus(), stream_id)
        except TokenpipeError as exc:  # cannot tell: the slot stays taken until it lapses
            log.debug("could not read a stream's last batch", extra={"request_id": stream_id, "error": exc.message})
            return False
        return last is not None and last.is_final

    def release(self, tenant: str, stream_id: str) -> None:
        self.open_streams.get(tenant, {}).pop(stream_id, None)

    def attach(self, tenant: str, stream_id: str) -> None:
        """A reader here is attached to the stream: its slot is held until it ends or is released."""
        mine = self.open_streams.get(tenant)
        if mine is not None and stream_id in mine:
            mine[stream_id] = math.inf

    def detach(self, tenant: str, stream_id: str) -> None:
        """The last reader here left an unfinished stream: the slot lapses after ``unread_stream_release_s``."""
        mine = self.open_streams.get(tenant)
        if mine is not None and stream_id in mine:
            mine[stream_id] = time.monotonic() + self.settings.unread_stream_release_s

    async def queue_depth(self, model: str) -> int:
        """Requests for ``model`` that wait: not yet pulled by any generator (JetStream consumer lag),
        and pulled beyond the generators' slots (their waiting rooms: delivered, not acked, past the
        slots their announcements give; a lower bound where a generator's KV cache runs short first)."""
        now = time.monotonic()
        cached = self._queue_info.get(model)
        if cached is not None and now - cached[0] < _QUEUE_INFO_TTL:
            return cached[1]
        try:
            # Bounded: while the consumer's leader is being elected (a NATS node died) nobody answers,
            # and admission must not wait out a 10 s API timeout for a number it may estimate.
            info = await self._bus().requests_js.consumer_info(REQUESTS_STREAM, consumer_name(model),
                                                               timeout=_QUEUE_INFO_TIMEOUT)
            depth = int(info.num_pending or 0) + max(0, int(info.num_ack_pending or 0) - self._slots(model))
        except Exception as exc:  # no consumer yet, or NATS restarting (submission retries): nothing counted
            log.debug("consumer info unavailable", extra={"model": model, "error": repr(exc)})
            depth = 0
        self._queue_info[model] = (now, depth)
        return depth
