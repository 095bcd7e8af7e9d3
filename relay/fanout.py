"""Live token batches for the SSE readers of one relay: one core subscription per stream read here.

A relay subscribes to ``tp.live.relay.<id>`` (the owner-scoped live subject: a batch arrives
there only after the store accepted it, tokenpipe.append, so live readers never see a batch a
replay would not) while it has a reader of that stream, so NATS delivers a batch only to the
relays that read its stream: adding relays adds capacity. Each message is decoded once and
handed to that stream's readers. (A shared ``tp.tok.relay.>`` subscription and one JetStream
consumer per reader were measured against this and removed: the shared one made every relay pay
for every batch published anywhere, 11-14 µs each, a cluster-wide ceiling whatever the relay count;
the consumers cost 1.7x the relay's CPU and 6x nats-server's per batch.)

Core delivery is at-most-once, so JetStream stays the source of truth: a reader catches up from
it when it opens (a new subscription reaches a cluster's other servers a moment later), again
``settle_s`` later, at a hole, within ``loss_spread_s`` of a reconnect or slow-consumer drop,
before declaring a gap, and after ``resync_s`` quiet (jittered). Order, duplicates and gaps are
:class:`~tokenpipe.reorder.Reorder`'s: readers see batches in ``seq`` order, each once, or an
explicit :class:`~tokenpipe.reorder.Gap`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenpipe.bus import Bus
from tokenpipe.errors import TransportError, WireFormatError
from tokenpipe.reorder import Reorder
from tokenpipe.streams import PING, StreamItem, batch_of, emitted_before, last_stored, stored
from tokenpipe.subjects import live_subject
from tokenpipe.wire import TokenBatch

__all__ = ["Fanout", "LiveStream"]

log = logging.getLogger(__name__)

# A reader whose looks at JetStream keep failing this long, with no batch delivered meanwhile, ends
# its stream with an error: a nats-server restart takes seconds, a deleted stream would never heal.
CATCH_UP_GIVE_UP_S = 20.0


class Fanout:
    """Dispatches ``tp.live.<owner>.<id>`` messages to the :class:`LiveStream` readers of each stream."""

    def __init__(self, bus: Bus, *, resync_s: float = 30.0, settle_s: float = 1.0,
                 reorder_wait: float = 15.0, loss_spread_s: float = 1.0,
                 give_up_s: float = CATCH_UP_GIVE_UP_S) -> None:
        self.bus = bus
        self.give_up_s = give_up_s
        self.resync_s = resync_s
        self.settle_s = settle_s
        self.reorder_wait = reorder_wait
        self.loss_spread_s = loss_spread_s
        # Its own generator: jitter needs no shared state, and the module's would be drawn from
        # inside other code's random sequences (Hypothesis flags exactly that in the WS tests).
        self.jitter = random.Random()
        self._loss_pending = False
        self._readers: dict[str, list[LiveStream]] = {}  # subject -> readers
        self._subs: dict[str, Subscription | None] = {}  # subject -> nats subscription (None while being made)
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.bus.on_possible_loss.append(self._on_possible_loss)

    async def stop(self) -> None:
        if self._on_possible_loss in self.bus.on_possible_loss:
            self.bus.on_possible_loss.remove(self._on_possible_loss)
        await asyncio.gather(*self._pending, return_exceptions=True)
        subs, self._subs = [s for s in self._subs.values() if s is not None], {}
        if not self.bus.nc.is_closed:
            for sub in subs:
                await sub.unsubscribe()

    @property
    def readers(self) -> int:
        return sum(len(v) for v in self._readers.values())

    def open(self, stream_id: str, *, after_seq: int = -1) -> LiveStream:
        """Register a reader now: every batch published from here on reaches it, and what was
        published before comes from JetStream."""
        reader = LiveStream(self, stream_id, after_seq=after_seq)
        self._readers.setdefault(reader.subject, []).append(reader)
        if reader.subject not in self._subs:
            self._subs[reader.subject] = None
            # nats-py's subscribe only queues the SUB (no round trip); as a task it still goes out
            # before anything the caller publishes next on this connection (the request).
            self._spawn(self._subscribe(reader.subject))
        return reader

    def _close(self, reader: LiveStream) -> None:
        readers = self._readers.get(reader.subject)
        if readers is not None and reader in readers:
            readers.remove(reader)
            if not readers:
                del self._readers[reader.subject]
        if reader.subject not in self._readers and reader.subject in self._subs:
            self._spawn(self._unsubscribe(reader.subject, self._subs.pop(reader.subject)))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _subscribe(self, subject: str) -> None:
        try:
            # Generous pending limits: a burst is better queued here than dropped (and re-read).
            sub = await self.bus.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=1 << 16,
                                              pending_bytes_limit=64 << 20)
        except Exception as exc:  # connection closing; readers still catch up from JetStream
            log.warning("stream subscription failed", extra={"subject": subject, "error": repr(exc)})
            self._subs.pop(subject, None)
            return
        if subject in self._subs and self._subs[subject] is None:
            self._subs[subject] = sub
        else:  # the last reader left while the SUB was being made
            await self._unsubscribe(subject, sub)

    async def _unsubscribe(self, subject: str, sub: Subscription | None) -> None:
        if sub is None or self.bus.nc.is_closed:
            return
        try:
            await sub.unsubscribe()
        except Exception as exc:  # reconnecting or closing: the server drops it with the connection
            log.debug("stream unsubscribe failed", extra={"subject": subject, "error": repr(exc)})

    async def _on_msg(self, msg: Msg) -> None:
        readers = self._readers.get(msg.subject)
        if not readers:
            return  # nobody here reads this stream: not even decoded
        batch = batch_of(self.bus, msg.data, msg.subject.rpartition(".")[2], msg.headers)
        if batch is None:
            return  # not a batch of this stream: logged and counted
        for reader in readers:
            reader._push(batch, msg.headers)

    def _on_possible_loss(self, sub: Subscription | None) -> None:
        """After a reconnect (``sub`` None) or a slow-consumer drop on our subscription: every
        reader reads JetStream in full within ``loss_spread_s``. nats-py reports a drop per
        message, so one pass per event-loop turn is scheduled, not one per report."""
        if sub is not None and sub not in self._subs.values():
            return
        if not self._loss_pending:
            self._loss_pending = True
            asyncio.get_running_loop().call_soon(self._schedule_resyncs)

    def _schedule_resyncs(self) -> None:
        self._loss_pending = False
        now = time.monotonic()
        spread = max(self.loss_spread_s, self.readers / 2000)  # each look is a JetStream consumer read
        for readers in self._readers.values():
            for reader in readers:
                reader._thorough = True
                reader._next_sync = min(reader._next_sync, now + self.jitter.random() * spread)
                reader._wake()  # to re-arm its timer for the earlier deadline


class LiveStream:
    """One reader of one stream, registered with its :class:`Fanout` from creation until
    :meth:`items` ends (or :meth:`close`)."""

    __slots__ = ("_fanout", "_inbox", "_next_sync", "_thorough", "_timer", "_timer_at", "_waiter",
                 "after_seq", "stream_id", "subject")

    def __init__(self, fanout: Fanout, stream_id: str, *, after_seq: int) -> None:
        self._fanout = fanout
        self.stream_id = stream_id
        self.subject = live_subject(fanout.bus.owner, stream_id)
        self.after_seq = after_seq
        self._inbox: list[tuple[TokenBatch, dict[str, str] | None]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._thorough = False  # the next look at JetStream reads everything (messages may be lost)
        self._next_sync = time.monotonic() + fanout.resync_s * (1 + 0.25 * fanout.jitter.random())

    def close(self) -> None:
        self._fanout._close(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _push(self, batch: TokenBatch, headers: dict[str, str] | None) -> None:
        self._inbox.append((batch, headers))
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake()

    async def _wait(self, deadline: float) -> None:
        """Until a push, a wake-up or the monotonic ``deadline``. This runs per batch, so the timer
        is not re-armed per wait: deadlines only move later with activity, and a timer that fires
        early just makes the caller recompute and wait again."""
        if self._inbox:
            return
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._on_timer)
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = fut
        try:
            await fut
        finally:
            self._waiter = None

    async def _catch_up(self, buf: Reorder, *, thorough: bool) -> None:
        """Feed ``buf`` what JetStream holds from ``buf.expected`` on (or the final batch, when
        resuming past the end). Unless ``thorough``, the last stored batch decides whether a
        full read is needed; after an outage it can be a republished older batch, so losses
        and holes read everything."""
        bus = self._fanout.bus
        self._next_sync = time.monotonic() + self._fanout.resync_s * (1 + 0.25 * self._fanout.jitter.random())
        if not thorough:
            try:
                entry = await last_stored(bus, self.stream_id)  # one direct get, no consumer
            except WireFormatError:  # the last stored message is no batch: the full read skips it
                entry = None
            else:
                if entry is None:
                    return
            if entry is not None:
                last, headers = entry
                if last.seq == buf.expected or (last.seq == buf.expected - 1 and not last.is_final):
                    # Nothing else to read; fed even when old: its headers carry the generation's trace context.
                    buf.feed(last, headers, now=time.monotonic())
                    return
        by_seq = await stored(bus, self.stream_id)
        now = time.monotonic()
        for batch, headers in by_seq.values():
            buf.feed(batch, headers, now=now)
        # Retention removed the start only if the oldest stored batch is old: a young one may be
        # waiting for earlier batches still to be stored (republished after a leader change), a
        # hole then, waited for like any other.
        if by_seq and emitted_before(by_seq[min(by_seq)][0], self._fanout.reorder_wait):
            buf.caught_up(min(by_seq), now=now)

    async def items(self, *, idle: float | None = None,
                    trace_headers: dict[str, str] | None = None) -> AsyncGenerator[StreamItem, None]:
        """Batches with ``seq > after_seq`` in order, ending after the final one; :data:`PING`
        after ``idle`` quiet seconds. ``trace_headers`` receives the first batch's trace context."""
        fanout = self._fanout
        buf = Reorder(self.after_seq, wait=fanout.reorder_wait, trace_headers=trace_headers)
        sync, settled = True, False
        looked_for: float | None = None  # the hole clock (``buf.hole_since``) already looked for
        last_out = time.monotonic()
        delivered = last_out  # when a batch (not a ping) last went out
        failing_since: float | None = None  # catch-up has failed since then
        try:
            while True:
                if sync:
                    # After a quiet resync interval the look goes through the stream leader's count
                    # (stored()): a direct get is answered by any replica, and one that is behind
                    # (a node thawed after a freeze) kept saying "nothing new" while the stream stalled.
                    quiet = time.monotonic() - delivered >= fanout.resync_s
                    sync, thorough, self._thorough = False, self._thorough or buf.holding or quiet, False
                    try:
                        await self._catch_up(buf, thorough=thorough)
                    except TransportError as exc:
                        # JetStream may still be recovering; live batches keep flowing meanwhile.
                        now = time.monotonic()
                        failing_since = now if failing_since is None else failing_since
                        if now - max(failing_since, delivered) > fanout.give_up_s:
                            # Not a restart any more: end the client's stream (an error event) instead of hanging.
                            raise TransportError(f"stream unavailable: reading its history kept failing for "
                                                 f"{fanout.give_up_s:g} s ({exc.message})") from exc
                        log.warning("stream catch-up failed; retrying", extra={"request_id": self.stream_id,
                                                                                "error": exc.message})
                        settled = False
                        self._thorough = thorough
                        self._next_sync = time.monotonic() + 0.5 + fanout.jitter.random()
                    else:
                        failing_since = None
                        if not settled or thorough:
                            # Again a moment later: a batch delivered just before this look can be
                            # stored just after it.
                            settled, self._next_sync = True, time.monotonic() + fanout.settle_s
                if self._inbox:
                    now = time.monotonic()
                    if not buf.holding:  # traffic postpones the idle resync, never a look for a hole
                        self._next_sync = now + fanout.resync_s
                    inbox, self._inbox = self._inbox, []
                    for batch, headers in inbox:
                        buf.feed(batch, headers, now=now)
                for item in buf.ready():
                    last_out = delivered = time.monotonic()
                    yield item
                if buf.done:
                    return
                now = time.monotonic()
                if buf.hole_since is not None and buf.hole_since != looked_for:
                    looked_for, sync = buf.hole_since, True  # a batch is missing: JetStream may have it already
                    continue
                deadline = buf.deadline
                if deadline is not None and now >= deadline:
                    try:  # one last full look before calling it lost
                        await self._catch_up(buf, thorough=True)
                    except TransportError as exc:
                        log.warning("stream catch-up failed", extra={"request_id": self.stream_id,
                                                                      "error": exc.message})
                    buf.expire(time.monotonic())
                    continue
                if idle and now >= last_out + idle:
                    last_out = now
                    yield PING
                    continue
                if now >= self._next_sync:
                    sync = True
                    continue
                await self._wait(min(self._next_sync, last_out + idle if idle else math.inf,
                                     math.inf if deadline is None else deadline))
        finally:
            self.close()
