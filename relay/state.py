"""What one relay process holds, and the NATS-facing operations its routers share."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import anyio
from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider

from tokenpipe.bus import Bus, connect
from tokenpipe.errors import InvalidRequest, ModelNotFound, NoGenerator, Overloaded, StreamNotFound
from tokenpipe.fanout import Fanout, LiveStream
from tokenpipe.metrics import RelayMetrics
from tokenpipe.settings import Settings
from tokenpipe.streams import (
    StreamItem,
    StreamMeta,
    cancel,
    follow,
    get_meta,
    last_batch,
    paced,
    stream_not_found,
    submit,
)
from tokenpipe.subjects import (
    ANNOUNCE_PREFIX,
    DISCOVER_SUBJECT,
    REQUESTS_STREAM,
    check_model_name,
    consumer_name,
    request_subject,
)
from tokenpipe.telemetry import extract_context, get_tracer, inject_headers
from tokenpipe.wire import Request, TokenBatch

from .auth import KeyRing
from .http import WriteWatchdog
from .registry import GeneratorRegistry
from .streamfanout import StreamFanout

__all__ = ["RelayState", "Session"]

log = logging.getLogger(__name__)

_QUEUE_INFO_TTL = 0.25  # seconds a consumer-lag reading is reused for admission decisions
_QUEUE_INFO_TIMEOUT = 0.5  # ... and how long one reading may take before it counts as unavailable
# How long a request waits for a generator whose announcements just lapsed: late (a stalled event
# loop), or reconnecting after its NATS node hung, which takes the stale-connection check (6-8 s).
_LAPSED_GRACE_S = 10.0
_LAPSED_RECENT_S = 30.0  # ... when they lapsed at most this long ago (long gone: 503 at once)
_RESERVATION_S = 900.0  # an unread stream holds its key's slot at most this long


@dataclass
class Session:
    """One client reading one stream; ``cancel_on_exit`` is cleared when the client may resume."""

    stream_id: str
    tenant: str
    cancel_on_exit: bool = True
    finished: bool = False
    live: LiveStream | None = None  # registered before submission (nothing published can be missed)

    def close(self) -> None:
        """Unregister the live reader; safe to call more than once, and needed when the response
        was cancelled before it ever read the stream."""
        if self.live is not None:
            self.live.close()


class RelayState:
    def __init__(self, settings: Settings, tracer_provider: TracerProvider | None = None) -> None:
        self.settings = settings
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.registry = GeneratorRegistry()
        self.keys = KeyRing.load(settings.api_keys, settings.api_keys_file)
        self.bus: Bus | None = None
        self.fanout: Fanout | None = None
        self.watchdog = WriteWatchdog(settings.slow_client_timeout_s)
        if settings.relay_fanout not in ("shared", "stream", "consumer"):
            raise InvalidRequest("relay_fanout must be 'shared', 'stream' or 'consumer', "
                                 f"not {settings.relay_fanout!r}", param="relay_fanout")
        self.active: Counter[str] = Counter()  # open readers per tenant
        self.open_streams: dict[str, dict[str, float]] = {}  # tenant -> {stream id: reservation expiry}
        self.metrics = RelayMetrics()
        self._queue_info: dict[str, tuple[float, int]] = {}
        self._discover_inbox = ""

    async def start(self) -> None:
        if not self.keys.enabled and self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("relay listens beyond loopback without API keys: set TOKENPIPE_API_KEYS",
                        extra={"host": self.settings.host})
        self.bus = await connect(self.settings, name="tokenpipe-relay")
        if self.settings.relay_fanout in ("shared", "stream"):
            self.fanout = Fanout(self.bus) if self.settings.relay_fanout == "shared" else StreamFanout(self.bus)
            await self.fanout.start()
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
        if self.fanout is not None:
            await self.fanout.stop()
        if self.bus is not None:
            await self.bus.close()

    async def _on_announce(self, msg: Any) -> None:
        self.registry.update(msg.data)

    def require_bus(self) -> Bus:
        # Reconnecting (its NATS node died) is not down: nats-py buffers what is sent meanwhile and
        # the JetStream calls retry, so a request in that window waits instead of failing.
        if self.bus is None or self.bus.nc.is_closed:
            raise NoGenerator("relay is not connected to NATS")
        return self.bus

    # -- admission -------------------------------------------------------------------
    async def resolve_model(self, model: Any) -> str:
        """The model to use; 404 if nobody ever served it, 503 if its generators are gone."""
        if model is None:
            models = self.registry.models()
            model = self.settings.model if self.settings.model in models or not models else models[0]
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string", param="model")
        check_model_name(model)
        wait_s = self.settings.generator_wait_s
        if not self.registry.has_model(model) and self.registry.recently_lapsed(model, _LAPSED_RECENT_S):
            # Announcements just lapsed: the generator may be gone, or only late (a stalled event
            # loop, a slow network). Ask it directly and give it a moment before answering 503.
            await self._discover()
            wait_s = max(wait_s, _LAPSED_GRACE_S)
        deadline = time.monotonic() + wait_s
        while not self.registry.has_model(model):
            if time.monotonic() >= deadline:
                if model in self.registry.seen_models:
                    raise NoGenerator(f"no generator is currently serving model {model!r}")
                known = ", ".join(self.registry.models()) or "none yet"
                raise ModelNotFound(f"model {model!r} is not served here (available: {known})", param="model")
            await asyncio.sleep(0.1)  # waiting for an announcement; bounded by generator_wait_s
        return model

    async def admit(self, tenant: str, model: str, stream_id: str) -> None:
        """Reserve a stream slot for ``tenant``; 429 when the key has too many unfinished streams
        or the model's queue is too deep. The slot is freed when a reader sees the stream end,
        when its owner cancels it, or after ``_RESERVATION_S`` (a stream nobody reads)."""
        now = time.monotonic()
        mine = self.open_streams.setdefault(tenant, {})
        for sid in [k for k, expiry in mine.items() if expiry < now]:
            del mine[sid]
        if len(mine) >= self.settings.max_streams_per_key:
            raise Overloaded(f"too many unfinished streams for this key (limit {self.settings.max_streams_per_key})")
        mine[stream_id] = now + _RESERVATION_S  # no await between the check and this: no race
        try:
            depth = await self.queue_depth(model)
            if depth > self.settings.max_queue_depth:
                raise Overloaded(f"{depth} requests are already waiting for {model!r}; retry shortly",
                                 retry_after=2)
        except BaseException:
            self.release(tenant, stream_id)
            raise

    def release(self, tenant: str, stream_id: str) -> None:
        self.open_streams.get(tenant, {}).pop(stream_id, None)

    async def queue_depth(self, model: str) -> int:
        """Requests for ``model`` not yet pulled by any generator (JetStream consumer lag)."""
        now = time.monotonic()
        cached = self._queue_info.get(model)
        if cached is not None and now - cached[0] < _QUEUE_INFO_TTL:
            return cached[1]
        bus = self.require_bus()
        try:
            # Bounded: while the consumer's leader is being elected (a NATS node died) nobody answers,
            # and admission must not wait out a 10 s API timeout for a number it may estimate.
            info = await bus.js.consumer_info(REQUESTS_STREAM, consumer_name(model), timeout=_QUEUE_INFO_TIMEOUT)
            depth = int(info.num_pending or 0)
        except Exception as exc:  # no consumer yet (no generator ever started): nothing is queued
            log.debug("consumer info unavailable", extra={"model": model, "error": repr(exc)})
            depth = 0
        self._queue_info[model] = (now, depth)
        return depth

    async def submit(self, request: Request, *, follow: bool = False) -> LiveStream | None:
        """Enqueue inside a PRODUCER span, a child of the current (HTTP server) span. With
        ``follow``, a live reader is registered first and returned (for :class:`Session`)."""
        bus = self.require_bus()
        live = self.fanout.open(request.id, fresh=True) if follow and self.fanout is not None else None
        try:
            await self._submit(bus, request)
        except BaseException:
            if live is not None:
                live.close()
            raise
        return live

    async def _submit(self, bus: Bus, request: Request) -> None:
        subject = request_subject(request.model)
        with self.tracer.start_as_current_span(
            f"publish {subject}", kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.operation.type": "publish",
                        "messaging.destination.name": subject, "gen_ai.request.model": request.model,
                        "tokenpipe.stream.id": request.id}):
            await submit(bus, request, inject_headers())
        log.info("stream created", extra={"request_id": request.id, "model": request.model,
                                          "tenant": request.tenant})

    async def owned_meta(self, stream_id: str, tenant: str) -> StreamMeta:
        """The stream's metadata if ``tenant`` owns it; otherwise 404, exactly as if it did not exist."""
        meta = await get_meta(self.require_bus(), stream_id)
        if meta.tenant != tenant:
            raise stream_not_found(stream_id)
        return meta

    async def check_retained(self, meta: StreamMeta) -> None:
        """404 saying so when a stream's tokens have aged out of JetStream."""
        age_s = (time.time_ns() - meta.created_at) / 1e9
        if age_s > self.settings.token_max_age_s and await last_batch(self.require_bus(), meta.id) is None:
            raise StreamNotFound(f"stream {meta.id!r} expired: token history is kept for "
                                 f"{self.settings.token_max_age_s:g} s and this stream is {age_s:.0f} s old")

    def _forward_span(self, session: Session, trace_headers: dict[str, str], *, resumed: bool) -> Any:
        """Live forwarding continues the generation's trace (the batches carry its context);
        a replay or resume is its own work, linked to the original trace."""
        origin = trace.get_current_span(extract_context(trace_headers)).get_span_context()
        attrs = {"tokenpipe.stream.id": session.stream_id, "messaging.system": "nats",
                 "messaging.operation.type": "receive"}
        if resumed or not origin.is_valid:
            links = [trace.Link(origin)] if origin.is_valid else []
            return self.tracer.start_span(f"replay {session.stream_id}", kind=SpanKind.CONSUMER, links=links,
                                          attributes=attrs)
        here = trace.get_current_span().get_span_context()
        links = [trace.Link(here)] if here.is_valid and here.trace_id != origin.trace_id else []
        return self.tracer.start_span(f"forward {session.stream_id}", context=extract_context(trace_headers),
                                      kind=SpanKind.CONSUMER, links=links, attributes=attrs)

    async def cancel(self, stream_id: str) -> None:
        await cancel(self.require_bus(), stream_id)

    async def batches(self, session: Session, *, after: int = -1, idle: float | None = None,
                      speed: float | None = None) -> AsyncGenerator[StreamItem, None]:
        """A stream's batches for one client (re-timed when ``speed`` is given); on early exit the
        generation is cancelled unless ``session.cancel_on_exit`` was cleared."""
        bus = self.require_bus()
        trace_headers: dict[str, str] = {}
        if session.live is None and self.fanout is not None:
            session.live = self.fanout.open(session.stream_id, after_seq=after)
        if session.live is not None:
            source = session.live.items(idle=idle, trace_headers=trace_headers)
        else:
            source = follow(bus, session.stream_id, after_seq=after, idle=idle, trace_headers=trace_headers)
        agen = source if speed is None else paced(source, speed)
        self.active[session.tenant] += 1
        self.metrics.active_sse.inc()
        opened = last = time.monotonic()
        span = None
        batches = 0
        try:
            async for item in agen:
                if isinstance(item, TokenBatch):
                    now = time.monotonic()
                    if span is None:
                        span = self._forward_span(session, trace_headers, resumed=after >= 0 or speed is not None)
                        span.add_event("first_batch", {"tokenpipe.batch.seq": item.seq})
                        self.metrics.first_batch.observe(now - opened)
                    else:
                        self.metrics.inter_batch.observe(now - last)
                    last = now
                    batches += 1
                    self.metrics.batches.inc()
                    if item.is_final:
                        session.finished = True
                        self.release(session.tenant, session.stream_id)
                        span.add_event("last_batch", {"tokenpipe.batch.seq": item.seq})
                        span.set_attribute("gen_ai.response.finish_reasons", [item.finish or ""])
                        if item.usage:
                            span.set_attribute("gen_ai.usage.output_tokens", item.usage.completion_tokens)
                yield item
        finally:
            self.active[session.tenant] -= 1
            self.metrics.active_sse.dec()
            if span is not None:
                span.set_attribute("tokenpipe.batches_forwarded", batches)
                span.end()
            # The client may be gone and this scope cancelled: shield the clean-up awaits.
            with anyio.CancelScope(shield=True):
                await agen.aclose()
                await source.aclose()
                session.close()
                if not session.finished and session.cancel_on_exit and bus.nc.is_connected:
                    log.info("client went away; cancelling", extra={"request_id": session.stream_id})
                    await cancel(bus, session.stream_id)
