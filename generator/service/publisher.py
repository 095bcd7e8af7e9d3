"""Ordered, conditional, confirmed appends of token batches, and request acks (the generator's NATS output).

Each stream a worker writes has an :class:`AppendChain`: its batches and, last, its request's
ack, in order. A chain has one append in flight at a time, and each append is conditional on the
stream's previous stored batch (``Nats-Expected-Last-Subject-Sequence``, :mod:`tokenpipe.append`):
the sequence comes from the previous PubAck, so a batch waits for its predecessor's PubAck, while
different streams' appends run concurrently. A stored batch then goes to the stream's live
subject, so live readers see only what the store accepted.

A refused append (error 10071: someone else appended since) means this worker lost the stream
(unless all that was stored since is junk, no batch of the stream: it appends after it,
:func:`~tokenpipe.append.junk_since`):
the chain drops what it still holds (its request's ack included: the delivery is the new
holder's now) and calls its ``on_lost``. A refusal without a sequence (error 10164: another append
to the subject is still being replicated) is no verdict and is retried. Failures that mean "NATS is
away" are retried until the batch is stored; a retry whose earlier try was stored after all is told
apart from a second writer by the stored message's ``Nats-Msg-Id`` (:func:`~tokenpipe.append.stored_as`).

Live copies go through :class:`~tokenpipe.append.LiveCopies`, which sends each stream's last one
again after a reconnect (one written to a server that died before passing it on is lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck

from tokenpipe.append import (
    JUNK_SKIPS,
    LiveCopies,
    StreamLost,
    conditional,
    in_process,
    junk_since,
    last_stored_as,
    refused_at,
    stored_as,
)
from tokenpipe.bus import Bus, release_intake
from tokenpipe.errors import TokenpipeError
from tokenpipe.retry import ELECTIONS, Backoff, transient
from tokenpipe.subjects import stream_key, token_subject

__all__ = ["AppendChain", "BatchPublisher"]

log = logging.getLogger(__name__)

_PUBACK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Ack:
    """Ack this delivery once every batch queued before it is stored."""

    msg: Msg


@dataclass(frozen=True)
class _Batch:
    data: bytes
    headers: dict[str, str]


@dataclass(eq=False)
class AppendChain:
    """One stream's way into the store: in order, one append in flight, each conditional on the last.

    ``last`` is the stream sequence of the stream's last stored message (0: nothing stored yet);
    a redelivered request's writer starts from what it read with the history it continues."""

    owner: str
    stream_id: str
    last: int
    on_lost: Callable[[StreamLost], None]
    subject: str = field(init=False)
    key: str = field(init=False)  # tokenpipe.subjects.stream_key: what the engine names the stream by
    lost: bool = False
    queue: deque[_Batch | _Ack] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.subject = token_subject(self.owner, self.stream_id)
        self.key = stream_key(self.owner, self.stream_id)


class _PubAcks:
    """One inbox for every append's PubAck, each resolved by its token; a refusal fails its future
    with the :class:`nats.js.errors.APIError` it carries. (nats-py's ``publish_async`` raises that
    error inside its reply callback instead, so its future only ever times out; ``js.publish``
    costs a task, a timer and a waiter per append, which at 32 streams was measurable CPU.)"""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prefix = ""
        self.waiting: dict[str, asyncio.Future[PubAck]] = {}
        self._sub: Subscription | None = None
        self._n = 0

    async def start(self) -> None:
        self.prefix = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(f"{self.prefix}.*", cb=self._on_reply)

    async def close(self) -> None:
        if self._sub is not None and not self.bus.nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # reconnecting or closing: the server drops it with the connection
                log.debug("PubAck inbox unsubscribe failed", extra={"error": repr(exc)})

    def expect(self) -> tuple[str, asyncio.Future[PubAck]]:
        self._n += 1
        token = str(self._n)
        fut: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self.waiting[token] = fut
        return f"{self.prefix}.{token}", fut

    def forget(self, reply: str) -> None:
        self.waiting.pop(reply.rpartition(".")[2], None)

    def fail_all(self, exc: BaseException) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _on_reply(self, msg: Msg) -> None:
        fut = self.waiting.pop(msg.subject.rpartition(".")[2], None)
        if fut is None or fut.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":  # no responders: the stream has no leader
            fut.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            resp = json.loads(msg.data)
            if "error" in resp:
                nats.js.errors.APIError.from_error(resp["error"])  # raises the matching subclass
            fut.set_result(PubAck.from_response(resp))
        except Exception as exc:  # the refusal, or an answer that is no PubAck
            fut.set_exception(exc)


class BatchPublisher:
    """The appends of every stream one worker writes (see the module docstring)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._busy: set[asyncio.Task[None]] = set()  # chains with something queued or in flight
        self._acks = _PubAcks(bus)
        self.live = LiveCopies(bus)  # the intake's error batches go out through it too
        self.on_live: Callable[[str], None] | None = None  # told each stream key whose batch went out live
        # Deliveries whose final batch is queued, each acked once its batches are stored: the worker's
        # progress acks keep them (by stream id), or a slow store hands a finished stream to a second writer.
        self.unacked: dict[str, Msg] = {}

    async def start(self) -> None:
        await self._acks.start()
        self.live.start()
        self.bus.on_possible_loss.append(self._on_possible_loss)

    def chain(self, owner: str, stream_id: str, *, last: int, on_lost: Callable[[StreamLost], None]) -> AppendChain:
        """A chain for one stream whose last stored sequence is ``last``."""
        return AppendChain(owner, stream_id, last, on_lost)

    def _on_possible_loss(self, sub: Subscription | None) -> None:
        """After a reconnect (``sub`` None): what was in flight on the old connection may never have
        reached a server (its server may be dead), so it goes out again now, not after a PubAck
        timeout (a retry that was stored after all is recognised as this writer's own)."""
        if sub is None:
            self._acks.fail_all(ConnectionResetError("sent again after a reconnect"))

    def publish(self, chain: AppendChain, data: bytes, headers: dict[str, str]) -> None:
        """Append ``data`` to ``chain``'s stream after whatever it holds (nothing, once it is lost)."""
        self._put(chain, _Batch(data, headers))

    def ack_after_published(self, chain: AppendChain, msg: Msg) -> None:
        """Ack ``msg`` once every batch queued on ``chain`` before it is stored (never, if it is lost);
        meanwhile it is in :attr:`unacked`."""
        if not chain.lost:
            self.unacked[chain.key] = msg
        self._put(chain, _Ack(msg))

    def _put(self, chain: AppendChain, item: _Batch | _Ack) -> None:
        if chain.lost:
            return
        chain.queue.append(item)
        if chain.task is None:
            task = asyncio.get_running_loop().create_task(self._drain(chain), name=f"append-{chain.stream_id}")
            chain.task = task
            self._busy.add(task)
            task.add_done_callback(self._busy.discard)

    async def flush(self) -> None:
        """Until everything queued so far is stored (or has waited out its retries' budget)."""
        if not self._busy:
            return
        _, pending = await asyncio.wait(list(self._busy), timeout=3 * _PUBACK_TIMEOUT_S)
        if pending:
            log.warning("some batches were not confirmed in time")

    async def close(self) -> None:
        if self._on_possible_loss in self.bus.on_possible_loss:
            self.bus.on_possible_loss.remove(self._on_possible_loss)
        busy = list(self._busy)
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await self.live.close()
        await self._acks.close()

    async def _drain(self, chain: AppendChain) -> None:
        try:
            while chain.queue:
                item = chain.queue.popleft()
                if isinstance(item, _Ack):
                    self._settled(chain, item.msg)
                    # Its place in its app's bound is free first: dying between the two then leaves no copy
                    # behind (the redelivery finds the stream final and only acks), the other way round
                    # one for max_age.
                    await release_intake(self.bus.js, item.msg.subject, item.msg.headers)
                    try:
                        await item.msg.ack()
                    except Exception as exc:  # an ack on a dead connection: the request is redelivered and resumed
                        log.warning("ack failed", extra={"request_id": chain.stream_id, "error": repr(exc)})
                else:
                    try:
                        await self._append(chain, item)
                    except StreamLost as lost:
                        chain.lost = True
                        for dropped in chain.queue:
                            if isinstance(dropped, _Ack):
                                self._settled(chain, dropped.msg)
                        chain.queue.clear()
                        chain.on_lost(lost)
                        return
        finally:
            chain.task = None

    def _settled(self, chain: AppendChain, msg: Msg) -> None:
        if self.unacked.get(chain.key) is msg:
            del self.unacked[chain.key]

    async def _append(self, chain: AppendChain, item: _Batch) -> None:
        """Until ``item`` is stored (or refused for good, and dropped: its readers see a gap).
        Raises :class:`StreamLost` when another writer appended to the stream."""
        # No tight loop while JetStream is unavailable (a stream between leaders refuses at once);
        # the first retry is immediate (a reconnect already waited).
        backoff = Backoff(ELECTIONS.first_delay_s, ELECTIONS.max_delay_s, immediate=True)
        tries = skips = 0
        while True:
            if tries:
                await asyncio.sleep(backoff.next())
                while not self.bus.nc.is_connected:
                    await asyncio.sleep(0.1)  # waiting out a reconnect
            tries += 1
            reply, fut = self._acks.expect()
            timer = asyncio.get_running_loop().call_later(_PUBACK_TIMEOUT_S, _time_out, fut)
            try:
                await self.bus.nc.publish(chain.subject, item.data, reply=reply,
                                          headers=conditional(item.headers, chain.last))
                ack = await fut
            except Exception as exc:  # refused, lost in an outage, or timed out
                if in_process(exc):  # another writer's append to the stream is being stored: its outcome decides
                    log.info("another append to the stream is in flight; appending again", extra={
                        "subject": chain.subject})
                    continue
                last = refused_at(exc)
                if last is not None:
                    if await self._was_ours(chain, last, item):
                        chain.last = last  # an earlier try was stored after all
                        break
                    if skips < JUNK_SKIPS and await junk_since(self.bus, chain.owner, chain.stream_id,
                                                               chain.last, last):
                        # No writer but junk the server was made to store there: still ours, after it.
                        log.warning("appending after junk stored on a stream's subject",
                                    extra={"subject": chain.subject, "stored_last": last, "expected": chain.last})
                        skips += 1
                        chain.last = last
                        continue
                    raise StreamLost(f"stream {chain.stream_id} was appended to by another writer "
                                     f"(stored last: {last}, expected {chain.last})", stored_last=last) from exc
                if not transient(exc):
                    log.error("batch refused; dropped", extra={"subject": chain.subject, "error": repr(exc)})
                    return
                log.warning("batch not confirmed; appending again", extra={"subject": chain.subject,
                                                                            "error": repr(exc)})
                continue
            finally:
                timer.cancel()
                self._acks.forget(reply)
            if ack.duplicate and not ack.seq:
                # A retry that met its own earlier try still being replicated: a clustered nats-server stages
                # a msg-id with sequence 0 until its proposal is applied, and a duplicate meeting it may be
                # answered with that 0 (where it checks, with error 10158 instead: transient, above). Taken
                # as stored at 0, the next append was conditional on 0, refused, and the stream "lost" with
                # nobody left writing it (a chaos run's stream never ended). The store says where the batch is
                # once the proposal is applied; until then, asked again.
                try:
                    stored = await last_stored_as(self.bus, chain.subject, item.headers.get("Nats-Msg-Id", ""))
                except TokenpipeError:
                    stored = 0
                if stored:
                    chain.last = stored
                    break
                log.warning("batch still being stored; asking again", extra={"subject": chain.subject})
                continue
            chain.last = ack.seq
            break
        try:
            await self.live.send(chain.owner, chain.stream_id, item.data, item.headers)
        except Exception as exc:  # live is at most once: readers fill the hole from the store
            log.warning("live copy not sent", extra={"subject": chain.subject, "error": repr(exc)})
        if self.on_live is not None:
            self.on_live(chain.key)

    async def _was_ours(self, chain: AppendChain, last: int, item: _Batch) -> bool:
        while True:
            try:
                return await stored_as(self.bus, chain.subject, last, item.headers.get("Nats-Msg-Id", ""))
            except TokenpipeError as exc:  # JetStream away: asked again, the delivery waits
                log.warning("cannot check the last stored batch; retrying",
                            extra={"subject": chain.subject, "error": exc.message})
                await asyncio.sleep(0.5)


def _time_out(fut: asyncio.Future[PubAck]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("no PubAck in time"))
