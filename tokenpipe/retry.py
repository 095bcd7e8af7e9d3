"""The one retry policy: which failures are worth another try, how long, and how far apart.

- :func:`transient` decides what "NATS is away" looks like (a stream between leaders, a
  client reconnecting, an answer that timed out): those are tried again; anything else (a
  refusal, a bug, malformed data — :class:`~tokenpipe.errors.WireFormatError` would be just as
  malformed next time) is raised at once.
- :class:`Retry` bounds one operation: its ``budget_s`` is the only deadline, and the parts of
  a retried operation try once each (retries never nest).
- :class:`Backoff` is the delay sequence, for the one loop that retries a stream of items rather
  than one call (the generator's PubAck confirmations).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import nats.errors
import nats.js.errors

from .errors import TransportError, WireFormatError

__all__ = ["ELECTIONS", "PATIENCE", "Backoff", "Retry", "queue_full", "retrying", "through_elections", "transient"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.js.errors.NoStreamResponseError,  # the stream's subjects have no responder: no leader yet
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,  # the request went to a server that died
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,  # reconnecting, and the buffer for meanwhile is full
    TimeoutError,
    ConnectionError,  # a publish lost with its connection
    TransportError,  # tokenpipe's own translation of the above
)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` means "not now" (worth another try) rather than "no"."""
    if isinstance(exc, WireFormatError) or queue_full(exc):  # a bound of TP_REQUESTS: refused again on a retry
        return False
    if isinstance(exc, _TRANSIENT):
        return True
    if not isinstance(exc, nats.js.errors.APIError):
        return False
    # 409 "duplicate message id is in process": the previous try is still being replicated.
    # (Some subclasses, KeyNotFoundError among them, never set code or description.)
    code, description = getattr(exc, "code", None), getattr(exc, "description", None) or ""
    return code == 503 or (code == 409 and "in process" in description)


def queue_full(exc: BaseException) -> bool:
    """Whether ``exc`` is JetStream refusing a message at a stream's bound (discard new: the
    request queue's size, or one owner's share of it), which nats-server answers with a 503."""
    description = str(getattr(exc, "description", None) or "")
    return isinstance(exc, nats.js.errors.APIError) and description.startswith("maximum ")


class Backoff:
    """Exponential delays from ``first_s`` up to ``max_s``; :meth:`reset` once things work again.
    ``immediate``: the first delay (and the first after a reset) is 0 — for a loop that retries
    many items in turn, where the items that failed during an outage must each go out at once
    after it, not each after a pause."""

    def __init__(self, first_s: float, max_s: float, *, immediate: bool = False) -> None:
        self.first_s, self.max_s, self.immediate = first_s, max_s, immediate
        self._next = 0.0 if immediate else first_s

    def next(self) -> float:
        delay, self._next = self._next, min(max(self._next * 2, self.first_s), self.max_s)
        return delay

    def reset(self) -> None:
        self._next = 0.0 if self.immediate else self.first_s


@dataclass(frozen=True)
class Retry:
    """How one operation is retried: for at most ``budget_s`` in all, ``attempt_timeout_s`` per
    try (None: the operation bounds itself), backing off from ``first_delay_s`` to ``max_delay_s``."""

    budget_s: float
    first_delay_s: float = 0.05
    max_delay_s: float = 1.0
    attempt_timeout_s: float | None = None

    def within(self, budget_s: float) -> Retry:
        return replace(self, budget_s=budget_s)


# A stream between leaders: nats-server's Raft elects a new one 4-9 s after the old leader
# vanished, and a client whose server died needs a moment to reconnect to another. An answer
# from a live leader takes milliseconds, so a try that takes seconds went to a dead server.
ELECTIONS = Retry(budget_s=15.0, attempt_timeout_s=2.0)
# A read a generator's delivery needs: waited out (the delivery kept alive meanwhile) rather than
# handed back, which would spend one of the request's few delivery attempts on an outage.
PATIENCE = Retry(budget_s=30.0, first_delay_s=0.25, max_delay_s=2.0)


async def retrying(op: Callable[[], Awaitable[T]], policy: Retry, *, what: str, request_id: str | None = None,
                   between: Callable[[], Awaitable[None]] | None = None,
                   worth: Callable[[BaseException], bool] = transient,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> T:
    """``op()``, tried again while it fails with an error ``worth`` another try (:func:`transient`),
    until ``policy.budget_s`` would be spent; then its last error is raised. ``between`` runs before
    each pause (a generator keeps its delivery alive with a progress ack)."""
    deadline = clock() + policy.budget_s
    backoff = Backoff(policy.first_delay_s, policy.max_delay_s)
    while True:
        try:
            if policy.attempt_timeout_s is None:
                return await op()
            return await asyncio.wait_for(op(), timeout=policy.attempt_timeout_s)
        except Exception as exc:
            delay = backoff.next()
            if not worth(exc) or clock() + delay >= deadline:
                raise
            log.warning("%s failed; retrying", what, extra={"request_id": request_id, "error": repr(exc)})
        if between is not None:
            await between()
        await sleep(delay)  # waiting out an election or a reconnect: there is no event to wait on


async def through_elections(op: Callable[[], Awaitable[T]], *, window_s: float = ELECTIONS.budget_s) -> T:
    """An idempotent JetStream call (a publish with ``Nats-Msg-Id``, a KV put of the same value,
    a get), tried again while the stream it needs is between leaders. On a single server this
    costs nothing: the first try answers."""
    return await retrying(op, ELECTIONS.within(window_s), what="jetstream call")
