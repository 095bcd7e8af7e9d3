"""Stream operations over NATS shared by the relay and the producer SDK: :func:`submit`, :func:`cancel`,
reads of what is stored, and :func:`follow`, from one ordered JetStream consumer: history and live
come through the same cursor, so nothing arriving during the switch can be lost or repeated.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from typing import Any

import nats.errors
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError, NotFoundError
from opentelemetry import trace

from . import streamindex
from .bus import Bus
from .errors import Overloaded, StreamNotFound, TransportError, WireFormatError
from .placement import Choice
from .reorder import Gap, Reorder
from .retry import ELECTIONS, Retry, queue_full, retrying, through_elections
from .storeinfo import ask_count, ask_pending, leader_count, requests_held
from .subjects import (
    RELAY_OWNER,
    TOKENS_STREAM,
    cancel_subject,
    check_stream_id,
    request_subject,
    token_subject,
)
from .wire import Cancel, Request, StreamMeta, TokenBatch

__all__ = ["PING", "Gap", "Ping", "StreamItem", "batches_between", "cancel", "emitted_before", "first_stored",
           "follow", "get_meta", "batch_of", "history", "history_at", "id_taken", "last_batch", "last_stored", "paced",
           "pending_requests", "stored", "stored_at", "stored_count",
           "stream_not_found", "submit"]

log = logging.getLogger(__name__)

# One JetStream API round trip: milliseconds when answered, but thousands of readers catching up
# at once after a reconnect queue up behind each other.
_CONSUMER_CREATE_TIMEOUT_S = 5.0
_COUNT_TIMEOUT_S = 2.0


class Ping:
    """Yielded by :func:`follow` when nothing arrived for ``idle`` seconds (SSE keep-alive)."""


PING = Ping()


StreamItem = TokenBatch | Ping | Gap


def emitted_before(batch: TokenBatch, seconds: float) -> bool:
    """Whether ``batch`` was emitted more than ``seconds`` ago. A stream whose oldest stored batch
    is that old lost its start to retention; a younger one may still be waiting for its first
    batches to be stored (republished after a NATS outage or a leader change)."""
    emitted = batch.timings.get("emitted")
    return emitted is None or time.time_ns() - emitted > seconds * 1e9


async def submit(bus: Bus, request: Request, headers: dict[str, str] | None = None, *,
                 retry: Retry = ELECTIONS) -> StreamMeta:
    """Record ownership (streams made in the relay's namespace) and enqueue as ``bus.owner``;
    the ownership record is returned. Both writes are idempotent (same value; same
    ``Nats-Msg-Id``), so they are tried again together under ``retry`` while NATS is away (a
    stream between leaders, a server restarting). Raises :class:`Overloaded` when the queue is at
    one of its bounds (its size, or this owner's share of it per model), :class:`TransportError`
    when it gives up, in both cases after cancelling the request (it may be enqueued without an
    owner record: nobody could read it)."""
    meta = StreamMeta(request.id, request.tenant, request.model, request.created_at or time.time_ns())
    hdrs = dict(headers or {})
    hdrs["Nats-Msg-Id"] = bus.msg_id(request.id)  # unique per owner, and no other owner can forge it
    payload = request.encode()  # before any write: an unencodable request leaves nothing behind
    choice = _placed(bus, request)

    async def both() -> None:
        # Concurrently (one round trip, not two, before the caller's 201): nothing reads the meta
        # entry before submit returns, and a generator never needs it. The request goes out first:
        # the server then stores and delivers it before it writes the meta entry. The registry is
        # the relay's: an app's streams (its own namespace) are not registered there.
        subject = request_subject(request.model, bus.owner, None if choice is None else choice.slot)
        writes: list[Awaitable[object]] = [bus.js.publish(subject, payload, headers=hdrs)]
        if bus.owner == RELAY_OWNER:
            writes.append(bus.meta.put(request.id, meta.encode()))
            # ... and its tenant's index, for listings (it never fails the submission:
            # tokenpipe.streamindex logs its own failure).
            writes.append(streamindex.record(bus, request, hdrs.get("traceparent", "")))
        failed = [r for r in await asyncio.gather(*writes, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    try:
        await retrying(both, retry, what="enqueue", request_id=request.id)
    except Exception as exc:
        if bus.nc.is_connected:
            await cancel(bus, request.id)
        if queue_full(exc):
            raise Overloaded(f"the request queue is full ({getattr(exc, 'description', exc)})",
                             retry_after=5) from exc
        if isinstance(exc, TimeoutError):
            raise TransportError("could not enqueue request: NATS did not answer in time") from exc
        raise TransportError(f"could not enqueue request: {exc or type(exc).__name__}") from exc
    return meta


def _placed(bus: Bus, request: Request) -> Choice | None:
    """Where ``request`` goes (tokenpipe.placement): a generator's slot, or None for the shared queue.
    Batch work (``flex``) always goes to the shared queue, where fair share between owners orders it.
    Said on the submitting span (the trace shows the generator chosen and the overlap)."""
    if bus.placement is None or request.batch:
        return None
    choice = bus.placement.choose(request, bus.owner)
    span = trace.get_current_span()
    if choice is not None:
        span.set_attributes({"tokenpipe.placement.worker": choice.worker, "tokenpipe.placement.slot": choice.slot,
                             "tokenpipe.placement.overlap_chunks": choice.overlap,
                             "tokenpipe.placement.reason": choice.reason})
    for hook in bus.on_placed:
        hook(choice)
    return choice


def batch_of(bus: Bus, data: bytes, stream_id: str, headers: Mapping[str, str] | None = None,
             owner: str | None = None) -> TokenBatch | None:
    """``data`` as a batch of ``stream_id``, or None (logged, and counted through
    ``bus.on_dropped_batch``) when it does not decode or names another stream: whoever managed to
    store or send it there, a reader never shows it as this stream's.

    ``headers`` (the message's) with ``owner`` (whose stream it is read as, default ``bus.owner``):
    also dropped when they show that the batch was written for another owner's stream. Every
    writer's ``Nats-Msg-Id`` is ``<owner>:<id>:…``, and a server that republishes a stored message (a
    direct get's answer, a consumer's delivery) keeps it and adds ``Nats-Subject``: the relay had a
    direct get of its own stream ``job-77`` answered onto ``tp.live.alice.job-77``, and alice's
    stream of that id showed the relay's text, live and in replay."""
    try:
        batch = TokenBatch.decode(data)
    except WireFormatError as exc:
        reason, detail = "undecodable", exc.message
    else:
        foreign = _foreign(headers or {}, owner or bus.owner, stream_id)
        if batch.id == stream_id and foreign is None:
            return batch
        reason, detail = (("wrong_stream", f"the batch names stream {batch.id!r}") if batch.id != stream_id
                          else ("wrong_owner", str(foreign)))
    log.warning("token message dropped", extra={"request_id": stream_id, "reason": reason, "error": detail})
    for hook in bus.on_dropped_batch:
        hook(reason)
    return None


def _foreign(headers: Mapping[str, str], owner: str, stream_id: str) -> str | None:
    """Why ``headers`` show a message written for another stream than ``owner``'s ``stream_id``, or None."""
    msg_id = headers.get("Nats-Msg-Id")
    if msg_id is not None and not msg_id.startswith(f"{owner}:{stream_id}:"):
        return f"written as {msg_id!r}"
    subject = headers.get("Nats-Subject")  # a republished stored message: where it was stored
    if subject is not None and subject != token_subject(owner, stream_id):
        return f"stored on {subject!r}"
    return None


def stream_not_found(stream_id: str) -> StreamNotFound:
    """The one 404 for a stream, whether it never existed, expired, or belongs to someone else."""
    return StreamNotFound(f"stream {stream_id!r} not found (unknown, or past retention)")


async def get_meta(bus: Bus, stream_id: str) -> StreamMeta:
    check_stream_id(stream_id)
    try:
        entry = await through_elections(lambda: bus.meta.get(stream_id))
    except KeyNotFoundError as exc:
        raise stream_not_found(stream_id) from exc
    except Exception as exc:
        raise TransportError(f"could not read stream metadata: {exc}") from exc
    if entry.value is None:
        raise stream_not_found(stream_id)
    return StreamMeta.decode(entry.value)


async def cancel(bus: Bus, stream_id: str) -> None:
    await bus.nc.publish(cancel_subject(bus.owner, stream_id), Cancel(stream_id, bus.owner).encode())


async def last_stored(bus: Bus, stream_id: str, *,
                      owner: str | None = None) -> tuple[TokenBatch, dict[str, str]] | None:
    """The newest batch kept for ``stream_id`` (of ``owner``, default ``bus.owner``) with the headers
    it carried (trace context included), or None if nothing was published or it expired. One
    direct get, no consumer."""
    try:
        raw = await bus.js.get_last_msg(TOKENS_STREAM, token_subject(owner or bus.owner, stream_id), direct=True)
    except NotFoundError:
        return None
    except Exception as exc:
        raise TransportError(f"could not read stream history: {exc}") from exc
    batch = batch_of(bus, raw.data or b"", stream_id, raw.headers, owner)
    if batch is None:
        raise WireFormatError(f"the last message stored for stream {stream_id!r} is no batch of it")
    return batch, dict(raw.headers or {})


async def last_batch(bus: Bus, stream_id: str, *, owner: str | None = None) -> TokenBatch | None:
    """The newest batch kept for ``stream_id`` (None if nothing was published or it expired)."""
    entry = await last_stored(bus, stream_id, owner=owner)
    return entry[0] if entry is not None else None


async def stored_count(bus: Bus, stream_id: str, *, owner: str | None = None) -> int:
    """How many messages TP_TOKENS holds for ``stream_id``, as its leader counts them.

    Not a direct get: every replica answers those, and on a cluster a replica that is behind
    (a node thawed after a freeze, catching up) answers from what it has — a read after a
    freeze got 48 of 49 messages from one — so "nothing more is stored" from a direct get or a
    consumer on any replica is not to be trusted."""
    if bus.store_questions:  # the relay under authorization: the admin counts (tokenpipe.storeinfo)
        _only_own(bus, owner)
        return await ask_count(bus.nc, stream_id, _COUNT_TIMEOUT_S + 1)
    return await _leader(leader_count(bus.js, TOKENS_STREAM, token_subject(owner or bus.owner, stream_id)),
                         "could not read stream history")


async def pending_requests(bus: Bus, model: str, owner: str | None = None) -> int:
    """How many of ``owner``'s requests for ``model`` the work queue holds: queued, or running (a
    generator acks a request only after its final batch is stored). 0 means none of them can still
    store a batch. Asked of the stream's leader, like :func:`stored_count`."""
    if bus.store_questions:
        _only_own(bus, owner)
        return await ask_pending(bus.nc, model, _COUNT_TIMEOUT_S + 1)
    return await _leader(requests_held(bus.js, model, owner or bus.owner), "could not read the request queue")


def _only_own(bus: Bus, owner: str | None) -> None:
    if owner not in (None, bus.owner):
        raise TransportError(f"the store answers {bus.owner!r} about its own streams only, not {owner!r}'s")


async def _leader(count: Awaitable[int], failed: str) -> int:
    """``count`` (a question to a stream's leader), bounded and its failure translated."""
    try:
        # Bounded well below the 10 s API timeout: while the stream is between leaders nobody
        # answers, and a caller that retries should do so soon after the new leader is in.
        return await asyncio.wait_for(count, timeout=_COUNT_TIMEOUT_S)
    except Exception as exc:
        raise TransportError(f"{failed}: {exc}") from exc


async def _open_history(bus: Bus, stream_id: str, owner: str | None, *, failed: str = "could not read stream history",
                        timeout: float | None = _CONSUMER_CREATE_TIMEOUT_S, start_seq: int = 0, **options: Any) -> Any:
    """An ordered consumer over ``stream_id``'s stored batches, from the first (``start_seq``: from
    that stream sequence on; ``options``: more of ``js.subscribe``'s)."""
    policy = js_api.DeliverPolicy.BY_START_SEQUENCE if start_seq > 0 else js_api.DeliverPolicy.ALL
    try:
        # Bounded: while TP_TOKENS is between leaders nobody answers the consumer create, and a
        # caller that retries (a reader filling a hole) should do so well before a 10 s API timeout.
        # Named: nats-py then puts the filter subject into the create request's subject
        # (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``), which is what lets NATS
        # permissions confine a reader to its owner's token subjects (tokenpipe.natsauth).
        return await asyncio.wait_for(
            bus.js.subscribe(token_subject(owner or bus.owner, stream_id), stream=TOKENS_STREAM,
                             ordered_consumer=True, deliver_policy=policy,
                             config=js_api.ConsumerConfig(name=f"tp{secrets.token_hex(10)}",
                                                          opt_start_seq=start_seq if start_seq > 0 else None),
                             **options),
            timeout=timeout)
    except Exception as exc:
        raise TransportError(f"{failed}: {exc}") from exc


async def stored(bus: Bus, stream_id: str, *,
                 owner: str | None = None) -> dict[int, tuple[TokenBatch, dict[str, str]]]:
    """Every batch JetStream holds for ``stream_id``, by ``seq``, with the headers it carried.

    Reads every stored message (until the consumer reports nothing pending): a stream stored
    before appends were conditional (tokenpipe.append) may hold a republished batch after later
    ones, or a duplicate, so "the last stored message" is not "the last batch". The count comes
    from the stream's leader (:func:`stored_count`); the consumer that reads lives on any
    replica, so a read that ends short of the count came from a replica that is behind and
    raises :class:`TransportError` (callers try again: the next consumer lands elsewhere, or
    the replica has caught up).
    """
    return (await stored_at(bus, stream_id, owner=owner))[0]


async def stored_at(bus: Bus, stream_id: str, *, owner: str | None = None
                    ) -> tuple[dict[int, tuple[TokenBatch, dict[str, str]]], int]:
    """:func:`stored`, and the stream sequence of the last message read (0: none): what a writer
    continuing the stream makes its first append conditional on (tokenpipe.append), so that
    anything stored after this read refuses it."""
    count = await stored_count(bus, stream_id, owner=owner)
    if count == 0:
        return {}, 0
    sub = await _open_history(bus, stream_id, owner)
    by_seq: dict[int, tuple[TokenBatch, dict[str, str]]] = {}
    read = last = 0
    try:
        while True:
            msg = await sub.next_msg(timeout=5.0)
            read += 1
            last = max(last, msg.metadata.sequence.stream)
            # Not a batch of it (nobody's to fix): skipped.
            batch = batch_of(bus, msg.data, stream_id, msg.headers, owner)
            if batch is not None:
                by_seq.setdefault(batch.seq, (batch, dict(msg.headers or {})))
            if msg.metadata.num_pending == 0:
                break
    except nats.errors.TimeoutError as exc:
        raise TransportError(f"stream {stream_id} history stalled") from exc
    finally:
        await _unsubscribe(sub, stream_id)
    if read < count:
        raise TransportError(f"stream {stream_id} history read from a replica that is behind "
                             f"({read} of {count} messages)")
    return by_seq, last


async def history(bus: Bus, stream_id: str, *, owner: str | None = None) -> list[TokenBatch]:
    """The contiguous batches ``seq 0..k`` stored so far for ``stream_id``, in order."""
    return (await history_at(bus, stream_id, owner=owner))[0]


async def history_at(bus: Bus, stream_id: str, *, owner: str | None = None) -> tuple[list[TokenBatch], int]:
    """:func:`history`, and the stream sequence of the last message stored for the stream when
    it was read (0: none; see :func:`stored_at`)."""
    by_seq, last = await stored_at(bus, stream_id, owner=owner)
    out: list[TokenBatch] = []
    while len(out) in by_seq and not (out and out[-1].is_final):
        out.append(by_seq[len(out)][0])
    return out, last


async def first_stored(bus: Bus, stream_id: str, *, owner: str | None = None) -> TokenBatch | None:
    """The oldest batch kept for ``stream_id`` (one message through an ordered consumer; a direct
    get of the first message of a subject is not confined to an owner's subjects), or None."""
    sub = await _open_history(bus, stream_id, owner)
    try:
        while True:
            msg = await sub.next_msg(timeout=_COUNT_TIMEOUT_S)
            batch = batch_of(bus, msg.data, stream_id, msg.headers, owner)
            if batch is not None:
                return batch
    except nats.errors.TimeoutError:
        return None  # nothing stored (yet, or any more)
    finally:
        await _unsubscribe(sub, stream_id)


async def batches_between(bus: Bus, stream_id: str, after: int, upto: int, *, owner: str | None = None) -> int:
    """How many of the messages stored for ``stream_id`` (of ``owner``) at stream sequences
    ``after < seq <= upto`` are batches of it (:func:`batch_of`). 0: whatever sits there is junk that
    someone had the server store on the stream's subject (a JetStream answer sent to it as a reply
    subject: inside one account no permission checks where the server's own answers go), which a
    writer may append after (tokenpipe.append). Raises :class:`TransportError` when the messages up
    to ``upto`` cannot be read (JetStream away; or removed meanwhile: nothing then says they were junk)."""
    if upto <= after:
        return 0
    sub = await _open_history(bus, stream_id, owner, start_seq=after + 1)
    found = 0
    try:
        while True:
            msg = await sub.next_msg(timeout=_COUNT_TIMEOUT_S)
            seq = msg.metadata.sequence.stream
            if seq > upto:
                break
            if batch_of(bus, msg.data, stream_id, msg.headers, owner) is not None:
                found += 1
            if seq == upto:
                break
    except nats.errors.TimeoutError as exc:
        raise TransportError(f"stream {stream_id}: its messages up to sequence {upto} could not be read") from exc
    finally:
        await _unsubscribe(sub, stream_id)
    return found


async def id_taken(bus: Bus, stream_id: str, *, owner: str | None = None) -> bool:
    """Whether ``stream_id`` (of ``owner``) has any batch stored: a new stream may not take its id.
    Junk on its subject (:func:`batches_between`) does not take it: the relay's credential could have
    the server store a JetStream answer there before the owner's stream existed, and the owner's
    request was then refused, or delayed by a redelivery."""
    subject = token_subject(owner or bus.owner, stream_id)
    try:
        raw = await bus.js.get_last_msg(TOKENS_STREAM, subject, direct=True)
    except NotFoundError:
        return False
    except Exception as exc:
        raise TransportError(f"could not read stream history: {exc}") from exc
    if batch_of(bus, raw.data or b"", stream_id, raw.headers, owner) is not None:
        return True
    return await batches_between(bus, stream_id, 0, int(raw.seq or 0), owner=owner) > 0


async def _unsubscribe(sub: Any, stream_id: str) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # connection already closing; the ephemeral consumer expires by itself
        log.debug("unsubscribe failed", extra={"stream_id": stream_id, "error": repr(exc)})


async def paced(source: AsyncIterator[StreamItem], speed: float, *,
                max_pause: float | None = None) -> AsyncGenerator[StreamItem, None]:
    """Re-time ``source`` by the batches' original ``emitted`` stamps divided by ``speed``
    (``speed <= 0``: as fast as possible), each pause at most ``max_pause`` seconds. Used for replays."""
    prev: int | None = None
    async for item in source:
        if isinstance(item, TokenBatch) and speed > 0:
            stamp = item.timings.get("emitted")
            if stamp is not None and prev is not None and stamp > prev:
                pause = (stamp - prev) / 1e9 / speed
                if max_pause is not None:
                    pause = min(pause, max_pause)
                await asyncio.sleep(pause)  # reproducing recorded pacing is the point
            if stamp is not None:
                prev = stamp
        yield item


async def follow(bus: Bus, stream_id: str, *, after_seq: int = -1) -> AsyncGenerator[StreamItem, None]:
    """Batches of ``stream_id`` with ``seq > after_seq``, in ``seq`` order, ending after the final one.

    Yields :data:`PING` after an hour without a batch. Order, duplicates and gaps are handled by
    :class:`~tokenpipe.reorder.Reorder`: a batch republished after a NATS outage can be stored
    after later ones, which are held back (up to its default wait, 15 s) until it arrives, so
    consumers always see contiguous batches, or an explicit :class:`Gap`.
    """
    sub = await _open_history(bus, stream_id, None, failed="could not follow stream", timeout=None,
                              idle_heartbeat=5.0)
    buf = Reorder(after_seq)
    oldest: TokenBatch | None = None
    try:
        while not buf.done:
            deadline = buf.deadline  # at most buf.wait ahead: far less than the hour
            timeout = 3600.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = await sub.next_msg(timeout=timeout)
            except nats.errors.TimeoutError:
                if not buf.expire(time.monotonic()):
                    yield PING
                    continue
            else:
                batch = batch_of(bus, msg.data, stream_id, msg.headers)
                if batch is None:
                    continue
                if oldest is None or batch.seq < oldest.seq:
                    oldest = batch  # the lowest seq the stream still holds (read from its start)
                now = time.monotonic()
                buf.feed(batch, now=now)
                if msg.metadata.num_pending == 0 and emitted_before(oldest, buf.wait):
                    buf.caught_up(oldest.seq, now=now)
            for item in buf.ready():
                yield item
    finally:
        await _unsubscribe(sub, stream_id)
