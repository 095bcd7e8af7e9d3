"""Pulling requests from JetStream, and answering the ones that cannot run.

Requests come from the shared durable consumer ``gen-<model>``, never more than
the batch has room for; a burst already waiting in the queue comes in one round trip. A
request that cannot run (undecodable, invalid, out of delivery attempts) gets an error batch
on its stream, so its client is told instead of waiting.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from tokenpipe.append import LiveCopies, StreamLost, append_once
from tokenpipe.bus import REPAIR_INTERVAL_S, Bus, consumer_drift, release_intake, request_consumer_config
from tokenpipe.errors import GenerationError, TokenpipeError, TransportError
from tokenpipe.retry import PATIENCE, retrying, through_elections
from tokenpipe.settings import Settings
from tokenpipe.streams import history_at
from tokenpipe.subjects import REQUESTS_STREAM, consumer_name, owner_of_request, shared_request_filter
from tokenpipe.wire import Request, TokenBatch, peek_request_id

__all__ = ["RequestIntake", "keep", "patiently"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class RequestIntake:
    """The pull subscription of one model's generators, and the max-deliveries advisories."""

    def __init__(self, bus: Bus, model: str, settings: Settings, live: LiveCopies | None = None) -> None:
        self.bus = bus
        self.live = live  # the worker's: an error batch's live copy is sent again after a reconnect
        self.model = model
        self.settings = settings
        self._psub: JetStreamContext.PullSubscription | None = None
        self._advisories: Subscription | None = None

    async def _update_consumer(self) -> None:
        """On an open bus (this generator provisions) an existing durable keeps the
        ``ack_wait``/``max_deliver`` it was created with (nats-py's pull_subscribe only binds to it):
        bring them to this worker's settings, in place."""
        config = request_consumer_config(self.settings, self.model)
        try:
            info = await self.bus.js.consumer_info(REQUESTS_STREAM, consumer_name(self.model))
        except NotFoundError:
            return  # pull_subscribe creates it
        drift = consumer_drift(info.config, config)
        if drift:
            await self.bus.js.add_consumer(REQUESTS_STREAM, config)  # create-or-update: same name, new fields
            log.info("request consumer updated", extra={"consumer": consumer_name(self.model),
                                                         "changed": ", ".join(drift)})

    async def _bind(self) -> JetStreamContext.PullSubscription:
        """Where there are users the consumer is the admin's (tokenpipe.bus.provision): bind to it,
        never create or change it. Missing (the admin not yet there, or this model not among the
        ones it serves, ``TOKENPIPE_MODELS``) is said, and asked again."""
        name = consumer_name(self.model)
        while True:
            try:
                await self.bus.js.consumer_info(REQUESTS_STREAM, name)
            except NotFoundError:
                log.error("the request consumer does not exist; the admin creates it for the models in "
                          "TOKENPIPE_MODELS (else TOKENPIPE_MODEL) of its provisioner",
                          extra={"consumer": name, "model": self.model})
                await asyncio.sleep(REPAIR_INTERVAL_S)  # the admin's next repair round; nothing to wait on
                continue
            return await self.bus.js.pull_subscribe_bind(durable=name, stream=REQUESTS_STREAM)

    async def subscribe(self) -> None:
        """Bind the model's durable consumer (on an open bus: creating or updating it). Tried again while
        JetStream does not answer (a cluster still electing its leaders at start): a generator exited on it before."""
        if self.bus.provisions:
            await through_elections(self._update_consumer)
            self._psub = await through_elections(lambda: self.bus.js.pull_subscribe(
                shared_request_filter(self.model),
                durable=consumer_name(self.model),
                stream=REQUESTS_STREAM,
                config=request_consumer_config(self.settings, self.model),
            ))
        else:
            self._psub = await through_elections(self._bind)
        # One worker per model (queue group) reports requests that ran out of delivery attempts.
        self._advisories = await self.bus.nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{REQUESTS_STREAM}.{consumer_name(self.model)}",
            queue=f"{consumer_name(self.model)}-advisories", cb=self._on_max_deliveries)

    async def close(self) -> None:
        for sub in (self._advisories, self._psub):
            if sub is not None:
                await sub.unsubscribe()

    async def resubscribe(self) -> None:
        """After ``TP_REQUESTS`` was re-provisioned (its consumer went with it): bind again."""
        await self.close()
        self._psub = self._advisories = None
        await self.subscribe()

    @property
    def pull(self) -> JetStreamContext.PullSubscription:
        """The pull subscription (after :meth:`subscribe`)."""
        if self._psub is None:
            raise TransportError("the request intake is not subscribed")
        return self._psub

    async def next_burst(self, free_slots: Callable[[], int], stopping: asyncio.Event,
                         share: Callable[[int], int] | None = None) -> list[Msg]:
        """The next request, and whatever else the queue already holds that fits in
        ``free_slots()``, at most ``share(pending)`` of the ``pending`` ones (a burst is split with idle
        peers). Raises ``TimeoutError`` when nothing arrived within a second."""
        # One at a time: nats-py's fetch(n) lingers for all n once the first arrives, which
        # would hold a lone request back; fetch(1) returns as soon as one is available.
        msgs: list[Msg] = await self.pull.fetch(1, timeout=1.0)
        pending = msgs[-1].metadata.num_pending if msgs else 0
        if share is not None:
            pending = min(pending, share(pending))
        while pending > 0 and free_slots() > len(msgs) and not stopping.is_set():
            try:
                more = await self.pull.fetch(min(pending, free_slots() - len(msgs)), timeout=0.02)
            except TimeoutError:
                break  # another worker took them
            except Exception as exc:  # keep what was fetched; the caller's next round retries the rest
                log.warning("fetch failed; retrying", extra={"error": repr(exc)})
                break
            msgs += more
            pending = min(more[-1].metadata.num_pending, pending - len(more)) if more else 0
        return msgs

    async def reject(self, msg: Msg, exc: TokenpipeError) -> None:
        """A request that cannot run (undecodable, invalid, its prompt over the bound): tell its stream
        (if an id can be read from it), then terminate. Never silence: its client would wait for ever."""
        rid = peek_request_id(msg.data)
        log.warning("rejecting invalid request", extra={"request_id": rid, "error": exc.message})
        try:
            owner: str | None = owner_of_request(msg.subject)
        except TokenpipeError:
            owner = None
        if rid is not None and owner is not None:
            batch = TokenBatch.error_for(rid, exc.message, exc.code)
            try:  # only as the stream's first batch: an id with history belongs to its first request
                await append_once(self.bus, owner, batch, expected_last=0, live=self.live)
            except StreamLost:
                log.warning("not ending a stream that has history", extra={"request_id": rid})
            except Exception as exc2:  # JetStream away: the client's reader ends on its own timeout
                log.warning("cannot end the rejected request's stream", extra={"request_id": rid,
                                                                              "error": repr(exc2)})
        await release_intake(self.bus.js, msg.subject, msg.headers)
        await msg.term()

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """Every attempt failed (workers died): end the client's stream with a clear error.

        Each JetStream call is retried through leader elections: this advisory comes once, so a
        read that fails during one (a node died: the same event that used up the attempts) would
        leave the client's stream open for ever, with nobody left to end it."""
        try:
            advisory = json.loads(msg.data)
            seq, attempts = int(advisory["stream_seq"]), int(advisory.get("deliveries", self.settings.max_deliver))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unusable max-deliveries advisory", extra={"error": str(exc)})
            return
        try:
            raw = await through_elections(lambda: self.bus.js.get_msg(REQUESTS_STREAM, seq), window_s=PATIENCE.budget_s)
        except NotFoundError:
            return  # already gone (another generator's copy of this advisory handled it)
        except Exception as exc:
            log.error("max-deliveries advisory: cannot read the request", extra={"seq": seq, "error": repr(exc)})
            return
        try:
            request = Request.decode(raw.data or b"")
            owner = owner_of_request(raw.subject or "")
            past, stored_last = await patiently(lambda: history_at(self.bus, request.id, owner=owner),
                                                what="reading history", request_id=request.id)
        except TokenpipeError as exc:
            log.error("cannot end a request that exhausted its deliveries", extra={"seq": seq, "error": exc.message})
            return
        try:
            if not past or not past[-1].is_final:
                produced = sum(len(b.token_ids) for b in past)
                batch = TokenBatch.error_for(
                    request.id,
                    f"generation failed: the request was attempted {attempts} times and every worker stopped",
                    GenerationError.code, seq=len(past), index=produced)
                # Conditional on what was read: a writer that still appends keeps the stream.
                await through_elections(
                    lambda: append_once(self.bus, owner, batch, expected_last=stored_last, live=self.live),
                    window_s=PATIENCE.budget_s)
                log.error("request exhausted its deliveries", extra={"request_id": request.id, "attempts": attempts})
            await release_intake(self.bus.js, raw.subject or "", raw.headers)
            await through_elections(lambda: self.bus.js.delete_msg(REQUESTS_STREAM, seq), window_s=PATIENCE.budget_s)
        except Exception as exc:  # JetStream stayed unavailable for PATIENCE.budget_s, or refused
            log.error("cannot end a request that exhausted its deliveries",
                      extra={"request_id": request.id, "error": repr(exc)})


async def patiently(op: Callable[[], Awaitable[T]], *, what: str, request_id: str | None,
                    msg: Msg | None = None, patience_s: float = PATIENCE.budget_s) -> T:
    """``op()`` under :data:`~tokenpipe.retry.PATIENCE` (JetStream unavailable: a stream between
    leaders), for up to ``patience_s``. ``msg``, the delivery this read is for, is kept meanwhile
    (progress acks): handing it back would spend one of the request's few delivery attempts on an
    outage that is not the request's fault."""
    between = None if msg is None else functools.partial(keep, msg, request_id)
    return await retrying(op, PATIENCE.within(patience_s), what=what, request_id=request_id, between=between)


async def keep(msg: Msg, request_id: str | None) -> None:
    """A progress ack for ``msg`` (the request ``request_id``). Best effort: while disconnected it
    cannot go out, and the delivery then lives on its ``ack_wait``; a failure is logged, never
    raised, so one request's ack cannot stop the others' (the worker's progress loop) or a retry."""
    try:
        await msg.in_progress()
    except Exception as exc:  # nats-py raises its connection errors here
        log.warning("in-progress ack failed", extra={"request_id": request_id, "error": repr(exc)})
