"""Ordered, confirmed publishing of token batches and request acks (the generator's NATS output).

Batches go out with ``js.publish_async`` (no wait per batch on the hot path); a confirm task
checks each PubAck in publish order and republishes what a NATS outage lost. A request's
ack rides the same ordered queue, so it is sent only after its final batch is stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck

from tokenpipe.bus import Bus
from tokenpipe.retry import ELECTIONS, Backoff, transient

__all__ = ["BatchPublisher"]

log = logging.getLogger(__name__)

_PUBACK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Ack:
    """Ack this delivery once every batch queued before it is stored."""

    msg: Msg


@dataclass
class _Pending:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    fut: asyncio.Future[PubAck] | None
    # When the PubAck is given up on: counted from the (re)publish, not from when the confirm
    # loop reaches the item, so batches lost together (a NATS node died) time out together.
    deadline: float = field(default_factory=lambda: time.monotonic() + _PUBACK_TIMEOUT_S)


class BatchPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        # batches to publish, and acks to send once what precedes them is stored, in one order
        self._outbox: asyncio.Queue[_Pending | _Ack] = asyncio.Queue()
        self._unconfirmed: asyncio.Queue[_Pending | _Ack] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: dict[asyncio.Future[PubAck], _Pending] = {}  # PubAcks not yet answered

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish_loop(), name="publish"),
                       asyncio.create_task(self._confirm_loop(), name="confirm")]
        self.bus.on_possible_loss.append(self._on_possible_loss)

    def _on_possible_loss(self, sub: Subscription | None) -> None:
        """After a reconnect (``sub`` None): what was in flight on the old connection may never have
        reached a server (its server may be dead), so it goes out again now, not after a PubAck
        timeout — live readers then get it within the reconnect, even before JetStream stores it."""
        if sub is None and self._inflight:
            task = asyncio.get_running_loop().create_task(self._resend(list(self._inflight.values())))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)

    async def _resend(self, items: list[_Pending]) -> None:
        for item in items:
            old = item.fut
            try:
                self._sent(item, await self.bus.js.publish_async(item.subject, item.data,
                                                                 headers=item.headers or None))
            except Exception as exc:  # the confirm loop retries it
                log.warning("republish after reconnect failed", extra={"subject": item.subject, "error": repr(exc)})
            if old is not None and not old.done():
                old.set_exception(ConnectionResetError("sent again after a reconnect"))
                old.exception()  # retrieved: the confirm loop may never look at this future

    def _sent(self, item: _Pending, fut: asyncio.Future[PubAck]) -> None:
        item.fut, item.deadline = fut, time.monotonic() + _PUBACK_TIMEOUT_S
        self._inflight[fut] = item
        fut.add_done_callback(self._forget)

    def _forget(self, fut: asyncio.Future[PubAck]) -> None:
        self._inflight.pop(fut, None)

    def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self._outbox.put_nowait(_Pending(subject, data, headers, None))

    def ack_after_published(self, msg: Msg) -> None:
        self._outbox.put_nowait(_Ack(msg))

    async def flush(self) -> None:
        """Until everything queued so far is stored (or has waited out its retries' budget)."""
        await self._outbox.join()
        try:
            await asyncio.wait_for(self._unconfirmed.join(), timeout=3 * _PUBACK_TIMEOUT_S)
        except TimeoutError:
            log.warning("some batches were not confirmed in time")

    async def close(self) -> None:
        if self._on_possible_loss in self.bus.on_possible_loss:
            self.bus.on_possible_loss.remove(self._on_possible_loss)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _publish_loop(self) -> None:
        """One publisher keeps every stream's batches in order. Publishes are JetStream-async
        (no wait per batch); the confirm loop checks each PubAck in order, so a request is
        acked only after its final batch is stored."""
        js = self.bus.js
        while True:
            item = await self._outbox.get()
            try:
                if isinstance(item, _Pending):
                    try:
                        self._sent(item, await js.publish_async(item.subject, item.data,
                                                                headers=item.headers or None))
                    except Exception as exc:  # a lost connection must not kill the publisher
                        log.warning("publish failed; retrying in the confirm loop",
                                    extra={"subject": item.subject, "error": repr(exc)})
                await self._unconfirmed.put(item)
            finally:
                self._outbox.task_done()

    async def _confirm_loop(self) -> None:
        """Wait for each batch's PubAck in publish order; republish what a NATS outage lost.

        ``Nats-Msg-Id`` makes a republish of a batch that did arrive a no-op. A republished batch
        can land after later ones; readers restore the order by ``seq`` (see ``streams.follow``).
        A batch is tried until stored while the failure is :func:`~tokenpipe.retry.transient`
        (its request's ack waits behind it; :meth:`flush` bounds shutdown); one JetStream refuses
        is dropped, and its readers see a gap.
        """
        # No tight loop while JetStream is unavailable (a stream between leaders refuses at once);
        # shared across batches and immediate after a success, so the ones that failed during an
        # outage are not each delayed once it is over (a pause each held hundreds of batches back
        # for tens of seconds after a TP_TOKENS leader kill: the fault tests' readers saw gaps).
        backoff = Backoff(ELECTIONS.first_delay_s, ELECTIONS.max_delay_s, immediate=True)
        while True:
            item = await self._unconfirmed.get()
            try:
                if isinstance(item, _Ack):
                    await item.msg.ack()
                elif await self._confirm(item, backoff):
                    backoff.reset()  # JetStream answers again: what failed meanwhile goes out at once
            except Exception as exc:  # an ack on a dead connection: the request is redelivered and resumed
                log.warning("ack failed", extra={"error": repr(exc)})
            finally:
                self._unconfirmed.task_done()

    async def _confirm(self, item: _Pending, backoff: Backoff) -> bool:
        """Until ``item`` is stored (True) or refused (False)."""
        while True:
            fut = item.fut
            try:
                if fut is None:
                    raise ConnectionError("never sent")
                await asyncio.wait_for(fut, timeout=max(0.0, item.deadline - time.monotonic()))
                return True
            except Exception as exc:  # lost in an outage, timed out, or refused
                if item.fut is not fut:
                    continue  # already sent again after a reconnect: wait for that one
                if fut is not None and not fut.done():
                    fut.cancel()
                if not transient(exc):
                    log.error("batch refused; dropped", extra={"subject": item.subject, "error": repr(exc)})
                    return False
                log.warning("batch not confirmed; republishing", extra={"subject": item.subject, "error": repr(exc)})
            await asyncio.sleep(backoff.next())
            while not self.bus.nc.is_connected:
                await asyncio.sleep(0.1)  # waiting out a reconnect
            try:
                self._sent(item, await self.bus.js.publish_async(item.subject, item.data, headers=item.headers or None))
            except Exception as again:
                log.warning("republish failed", extra={"error": repr(again)})
                item.fut = None
