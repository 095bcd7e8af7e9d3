"""The relay's side of a stream: submitting it, checking who may read it, forwarding its
batches to one client (spans, metrics), and cancelling it.

Viewers are not owners: a reader's disconnect cancels the generation only when it was the
last live reader of a still-running stream on every relay, and none re-attached within
``cancel_grace_s`` (so a reconnect with ``Last-Event-ID`` continues the stream). Replays are
not readers and never cancel; an explicit ``DELETE`` by the owner always does. Before
cancelling, a relay asks the others on ``tp.readers.<id>``: every relay holding a live reader
of the stream answers; no answer within ``_READERS_ASK_S`` means there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import anyio
import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from tokenpipe.bus import Bus
from tokenpipe.errors import NoGenerator, StreamExpired, TokenpipeError, TransportError, WireFormatError
from tokenpipe.metrics import RelayMetrics
from tokenpipe.retry import ELECTIONS
from tokenpipe.settings import Settings
from tokenpipe.streamindex import rebuild_meta
from tokenpipe.streams import (
    Ping,
    StreamItem,
    cancel,
    get_meta,
    last_batch,
    paced,
    pending_requests,
    stream_not_found,
    submit,
)
from tokenpipe.subjects import READERS_WILDCARD, RELAY_OWNER, readers_subject, request_subject
from tokenpipe.telemetry import extract_context, producer_span
from tokenpipe.wire import Request, StreamMeta, TokenBatch

from .admission import Admission
from .fanout import Fanout, LiveStream

__all__ = ["Forwarder", "Session", "MAX_REPLAY_PAUSE_S"]

log = logging.getLogger(__name__)

MAX_REPLAY_PAUSE_S = 5.0  # a replay's longest pause between two batches, whatever the recorded gap
_READERS_ASK_S = 0.25  # how long a relay waits for another to say it holds a live reader
_CREATED_HERE = 10_000  # owner records of the streams created here last, kept for their first GET


@dataclass
class Session:
    """One client reading one stream. ``reader``: a live reader (keeps the generation alive;
    a replay is not one); ``cancel_on_exit``: leaving may cancel it (cleared when the client
    may resume, or asked not to)."""

    stream_id: str
    tenant: str
    cancel_on_exit: bool = True
    reader: bool = True
    finished: bool = False
    live: LiveStream | None = None  # registered before submission (nothing published can be missed)
    meta: StreamMeta | None = None  # an attach: its idle pings ask whether the stream is gone (Forwarder.batches)

    def dropped(self) -> None:
        """A slow client was cut off, not its generation: it may resume."""
        self.cancel_on_exit = False

    def close(self) -> None:
        """Unregister the live reader; safe to call more than once, and needed when the response
        was cancelled before it ever read the stream."""
        if self.live is not None:
            self.live.close()


class Forwarder:
    """Stream operations of one relay process; ``fanout`` is set once the relay is connected."""

    def __init__(self, settings: Settings, tracer: Tracer, metrics: RelayMetrics, admission: Admission,
                 bus: Callable[[], Bus]) -> None:
        self.settings = settings
        self.tracer = tracer
        self.metrics = metrics
        self.admission = admission
        self._bus = bus
        self.fanout: Fanout | None = None
        self.active: Counter[str] = Counter()  # open readers per tenant
        self.readers: Counter[str] = Counter()  # live (non-replay) readers per stream id, on this relay
        self._grace: dict[str, asyncio.Task[None]] = {}  # stream id -> its grace, while it is pending
        self._tasks: set[asyncio.Task[None]] = set()  # every cancel-after-grace still running
        # The owner records this relay wrote itself (they never change): a client's GET right after
        # its POST, to this relay, need not read its record back from the meta bucket (a round trip
        # on the first token's path).
        self._created: OrderedDict[str, StreamMeta] = OrderedDict()

    async def start(self) -> None:
        bus = self._bus()
        self.fanout = Fanout(bus)
        await self.fanout.start()
        await bus.nc.subscribe(READERS_WILDCARD, cb=self._on_readers_query)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._grace.clear()
        if self.fanout is not None:
            await self.fanout.stop()

    async def _on_readers_query(self, msg: Msg) -> None:
        """Answer also while a reader that left here is within its grace (this relay decides then)."""
        stream_id = msg.subject.rpartition(".")[2]
        if (self.readers.get(stream_id) or stream_id in self._grace) and msg.reply:
            await msg.respond(b"1")

    def _attach(self, session: Session) -> None:
        pending = self._grace.pop(session.stream_id, None)
        if pending is not None:
            pending.cancel()  # a reader is back: the next one to leave starts a fresh grace
        self.readers[session.stream_id] += 1
        if self.readers[session.stream_id] == 1:
            self.admission.attach(session.tenant, session.stream_id)

    def _detach(self, session: Session) -> bool:
        """Unregister a live reader; True when it was this relay's last one of that stream."""
        self.readers[session.stream_id] -= 1
        if self.readers[session.stream_id] > 0:
            return False
        del self.readers[session.stream_id]
        if not session.finished:
            self.admission.detach(session.tenant, session.stream_id)
        return True

    def _cancel_after_grace(self, session: Session) -> None:
        if session.stream_id in self._grace:
            return
        task = asyncio.get_running_loop().create_task(self._grace_then_cancel(session),
                                                      name=f"cancel-grace-{session.stream_id}")
        self._grace[session.stream_id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _grace_then_cancel(self, session: Session) -> None:
        await asyncio.sleep(self.settings.cancel_grace_s)  # the grace itself: a reader may re-attach
        self._grace.pop(session.stream_id, None)  # no longer pending: this relay must not answer itself
        if self.readers.get(session.stream_id):
            return
        try:
            bus = self._bus()
            if await self._read_elsewhere(bus, session.stream_id):
                return
            last = await last_batch(bus, session.stream_id)
            if last is not None and last.is_final:
                return  # it ended meanwhile: nothing to cancel
            log.info("last reader went away; cancelling", extra={"request_id": session.stream_id})
            await cancel(bus, session.stream_id)
            self.admission.release(session.tenant, session.stream_id)
        except TokenpipeError as exc:
            log.warning("could not cancel an abandoned stream", extra={"request_id": session.stream_id,
                                                                        "error": exc.message})

    async def _read_elsewhere(self, bus: Bus, stream_id: str) -> bool:
        """Whether another relay holds a live reader of the stream (one answer is enough)."""
        try:
            await bus.nc.request(readers_subject(stream_id), b"", timeout=_READERS_ASK_S)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False  # nobody answered: no relay holds one
        except nats.errors.Error as exc:  # cannot ask: keep the generation rather than cancel blindly
            log.warning("could not ask other relays for readers", extra={"request_id": stream_id, "error": repr(exc)})
            return True
        return True

    async def submit(self, request: Request, *, follow: bool = False) -> LiveStream | None:
        """Enqueue inside a PRODUCER span (a child of the HTTP server span); with ``follow``, a live
        reader is registered first and returned."""
        live = self._fanout().open(request.id) if follow else None
        try:
            with producer_span(self.tracer, request_subject(request.model, RELAY_OWNER),
                               {"gen_ai.request.model": request.model, "tokenpipe.stream.id": request.id}) as headers:
                # Retried while NATS is away: a nats-server restart takes a second or two, an election 4-9 s.
                bus = self._bus()
                meta = await submit(bus, request, headers, retry=ELECTIONS.within(self.settings.submit_retry_s))
        except BaseException:
            if live is not None:
                live.close()
            self.admission.release(request.tenant, request.id)  # a stream never created holds no slot
            raise
        if bus.owner == RELAY_OWNER:  # the record is in the meta bucket (tokenpipe.streams.submit)
            self._created[meta.id] = meta
            while len(self._created) > _CREATED_HERE:
                self._created.popitem(last=False)
        log.info("stream created", extra={"request_id": request.id, "model": request.model,
                                          "tenant": request.tenant})
        return live

    def _fanout(self) -> Fanout:
        if self.fanout is None:
            raise NoGenerator("relay is not connected to NATS")
        return self.fanout

    async def owned_meta(self, stream_id: str, tenant: str) -> StreamMeta:
        """The stream's metadata if ``tenant`` owns it; otherwise 404, exactly as if it did not exist."""
        meta = self._created.get(stream_id)
        # The bucket keeps a record for twice the tokens' age: a copy younger than that is still there.
        # Another tenant's stream is read from the bucket like a missing one, so that both answers
        # cost the same round trip (a faster 404 would tell which ids exist).
        aged = meta is not None and (time.time_ns() - meta.created_at) / 1e9 > self.settings.token_max_age_s
        if meta is None or meta.tenant != tenant or aged:
            try:
                meta = await get_meta(self._bus(), stream_id)
            except WireFormatError as exc:  # junk stored over the record: rebuilt for its owner only
                meta = await rebuild_meta(self._bus(), stream_id, tenant)
                if meta is None:
                    raise stream_not_found(stream_id) from exc
        if meta.tenant != tenant:
            raise stream_not_found(stream_id)
        return meta

    async def check_retained(self, meta: StreamMeta) -> None:
        """404 ``expired`` when the stream's history is gone and nothing more will be stored: its
        tokens aged out of JetStream, or were removed (a purge) after it ended. A stream younger
        than ``keepalive_s`` is not asked here (a client's GET right after its POST: no round trip
        on the first token's path); its reader's first idle ping asks (:meth:`batches`)."""
        age_s = (time.time_ns() - meta.created_at) / 1e9
        if age_s > self.settings.token_max_age_s and not await self._stored_any(meta.id):
            raise StreamExpired(f"stream {meta.id!r} expired: token history is kept for "
                                f"{self.settings.token_max_age_s:g} s and this stream is {age_s:.0f} s old")
        if age_s > self.settings.keepalive_s:
            await self._check_gone(meta)

    async def _check_gone(self, meta: StreamMeta) -> None:
        """:class:`StreamExpired` when nothing is stored for the stream and no request for its model
        is queued or running (a request stays in the work queue until its final batch is stored).
        The queue is asked first, so a stream that ends between the two looks is seen stored."""
        bus = self._bus()
        try:
            if await pending_requests(bus, meta.model, RELAY_OWNER) or await self._stored_any(meta.id):
                return
        except TransportError as exc:  # JetStream between leaders: cannot tell, so not gone
            log.warning("could not tell whether a stream is gone", extra={"request_id": meta.id,
                                                                          "error": exc.message})
            return
        log.warning("stream history gone; answering expired", extra={"request_id": meta.id})
        raise StreamExpired(f"stream {meta.id!r} expired: its token history is gone (past retention, or "
                            "removed) and it is neither queued nor running")

    async def _stored_any(self, stream_id: str) -> bool:
        """Whether anything is stored for the stream (a last message that is no batch of it, junk
        that readers drop, still counts: the readers decide what to show)."""
        try:
            return await last_batch(self._bus(), stream_id) is not None
        except WireFormatError:
            return True

    async def cancel(self, stream_id: str, tenant: str) -> None:
        """The owner's explicit cancel (404 to anyone else), which also frees the stream's slot."""
        await self.owned_meta(stream_id, tenant)
        await cancel(self._bus(), stream_id)
        self.admission.release(tenant, stream_id)

    def _forward_span(self, session: Session, trace_headers: dict[str, str], *, resumed: bool) -> Span:
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

    async def batches(self, session: Session, *, after: int = -1, idle: float | None = None,
                      speed: float | None = None) -> AsyncGenerator[StreamItem, None]:
        """A stream's batches for one client (re-timed when ``speed`` is given); on early exit the
        generation is cancelled unless ``session.cancel_on_exit`` was cleared."""
        trace_headers: dict[str, str] = {}
        if session.live is None:
            session.live = self._fanout().open(session.stream_id, after_seq=after)
        source = session.live.items(idle=idle, trace_headers=trace_headers)
        agen = source if speed is None else paced(source, speed, max_pause=MAX_REPLAY_PAUSE_S)
        if session.reader:
            self._attach(session)
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
                        self.admission.release(session.tenant, session.stream_id)
                        span.add_event("last_batch", {"tokenpipe.batch.seq": item.seq})
                        span.set_attribute("gen_ai.response.finish_reasons", [item.finish or ""])
                        if item.usage:
                            span.set_attribute("gen_ai.usage.output_tokens", item.usage.completion_tokens)
                elif isinstance(item, Ping) and session.meta is not None:
                    # Idle: a history wiped (or aged out) while nothing more can come would ping forever.
                    await self._check_gone(session.meta)
                yield item
        except TokenpipeError:
            self.admission.release(session.tenant, session.stream_id)  # it ended (in error): its slot is free
            raise
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
            last_here = self._detach(session) if session.reader else False
            if last_here and not session.finished and session.cancel_on_exit:
                self._cancel_after_grace(session)
