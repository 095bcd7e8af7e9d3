"""One request's way out of the generator: coalescing, its time window, publishing, finishing.

The worker hands every engine emission for a request to that request's :class:`StreamWriter`.
It coalesces the tokens (the first at once, then by the count or the time window, the final
batch immediately), appends each batch to ``tp.tok.<owner>.<id>`` through its
:class:`~generator.service.publisher.AppendChain` on the worker's shared
:class:`~generator.service.publisher.BatchPublisher` with the generation's trace context, and finishes
the request exactly once: metrics and spans, then the ack, which the publisher sends only after
the final batch is stored. No NATS here: the publisher is the transport. When the store refuses
an append (another writer holds the stream now) the writer stops at once.

A first delivery is not yet cleared to publish: the worker checks that its stream id is free
while the engine already works on it (the check is a NATS round trip, the engine's admission
and prefill take longer), and its batches wait here until :meth:`StreamWriter.clear` — or are
never published, after :meth:`StreamWriter.refuse`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Tracer

from tokenpipe.append import StreamLost
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.streamrecord import SERVED_BY_HEADER
from tokenpipe.subjects import RELAY_OWNER, stream_key
from tokenpipe.telemetry import inject_headers
from tokenpipe.wire import Request, TokenBatch

from ..engine.handle import Emission
from .coalesce import Coalescer
from .observe import Timeline
from .publisher import BatchPublisher

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["OutputContext", "StreamWriter"]


@dataclass(frozen=True)
class OutputContext:
    """What every request of one worker shares on its way out."""

    settings: Settings
    publisher: BatchPublisher
    metrics: GeneratorMetrics
    tracer: Tracer
    finished: Callable[[StreamWriter, TokenBatch], None]  # after the final batch is queued and the ack with it
    lost: Callable[[StreamWriter, StreamLost], None]  # the store refused an append: another writer holds it
    worker: str | None = None  # this generator's id, on each delivery's first batch (TokenBatch.served_by)


class StreamWriter:
    """The output path of one running request (see the module docstring)."""

    def __init__(self, ctx: OutputContext, request: Request, msg: Msg | None, span: Any, *,
                 past: Sequence[TokenBatch] = (), stored_last: int = 0, received: int, owner: str = RELAY_OWNER,
                 cleared: bool = True) -> None:
        """``past`` holds the batches already published for a redelivered request: numbering
        continues after them, and the first append is conditional on ``stored_last``, the stream
        sequence of the last message stored for the stream when ``past`` was read (0: none).
        ``received`` is when this worker pulled the request (ns).
        ``owner`` published the request (from its subject): the batches go to its token subjects.
        Unless ``cleared``, batches are held until :meth:`clear` (or dropped by :meth:`refuse`)."""
        self.ctx = ctx
        self.request = request
        self.owner = owner
        self.key = stream_key(owner, request.id)  # the worker's and the engine's name for this stream
        self.msg = msg
        self.span = span
        resumed = sum(len(b.token_ids) for b in past)
        co, settings = request.coalesce, ctx.settings
        self.coalescer = Coalescer(
            request.id,
            max_tokens=co.max_tokens if co.max_tokens is not None else settings.coalesce_max_tokens,
            max_delay_ns=int(1e6 * (co.max_delay_ms if co.max_delay_ms is not None
                                    else settings.coalesce_max_delay_ms)),
            start_seq=past[-1].seq + 1 if past else 0,
            start_index=resumed,
            first_timings={"created": request.created_at, "received": received},
        )
        self.timeline = Timeline(created=request.created_at, received=received, resumed_tokens=resumed)
        self.headers = inject_headers(span=span)  # every batch carries the generation's trace context
        self._said_served = False
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.refused = False  # the stream id was taken: nothing of this request is ever published
        self.chain = ctx.publisher.chain(owner, request.id, last=stored_last, on_lost=self._on_lost)
        # Unique to this writer: a retry of its own append is told apart from another writer's by it.
        self._tag = secrets.token_hex(4)
        self._held: list[TokenBatch] | None = None if cleared else []

    def emit(self, em: Emission) -> None:
        """Take what one engine step produced for this request."""
        if self.closed:
            return
        if em.admitted_ns:
            self.coalescer.first_timings["admitted"] = em.admitted_ns
            self.timeline.admitted = em.admitted_ns
        if em.token_ids:
            self.timeline.on_token(self.ctx.metrics, em.at_ns)
        batch = self.coalescer.add(list(em.token_ids), em.text, em.at_ns, finish=em.finish, error=em.error,
                                   usage=em.usage, error_code=em.error_code)
        if batch is not None:
            self._send(batch)
        self._arm_timer()

    @property
    def started(self) -> bool:
        """The engine admitted it (or it produced a token): it runs, or ran and was preempted."""
        return bool(self.timeline.admitted or self.timeline.first_token)

    @property
    def checked(self) -> bool:
        """Its stream id is known to be free (a redelivery is never checked again): it may be handed back."""
        return self._held is None and not self.refused

    def clear(self) -> None:
        """The stream id is free: publish what was held, in order, and every batch from now on at once."""
        held, self._held = self._held, None
        if self.closed or held is None:
            return
        for batch in held:
            self._send(batch)

    def refuse(self) -> None:
        """Publish nothing of this request, ever, nor ack it (its message is the worker's to
        terminate or hand back). The worker also cancels it in the engine; the request is done
        here once the engine's final emission for it arrived (it may already have)."""
        held, self._held = self._held or [], None
        if self.closed:
            return
        self.refused = True
        self.msg = None
        if held and held[-1].is_final:
            self._finish(held[-1])

    def _on_lost(self, exc: StreamLost) -> None:
        """The store refused an append: stop now, publish nothing more, never ack (the delivery is
        the new holder's); the worker cancels the request in the engine and frees its slot. The
        chain calls it once: a lost chain takes nothing more."""
        self.msg = None
        if not self.closed:  # else finished or handed back already, its span ended
            self.closed = True
            self._cancel_timer()
            self.span.set_attribute("tokenpipe.lost", True)
            self.span.end()
        self.ctx.lost(self, exc)

    def abandon(self) -> None:
        """Stop without a final batch (the request goes back to the queue): tokens coalesced but
        not yet sent are dropped, and the next worker continues after what was published."""
        self.closed = True
        self._cancel_timer()
        self.span.end()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _arm_timer(self) -> None:
        self._cancel_timer()
        deadline = self.coalescer.deadline()
        if deadline is not None and not self.closed:
            delay = max(0.0, (deadline - time.time_ns()) / 1e9)
            self.timer = asyncio.get_running_loop().call_later(delay, self._on_deadline)

    def _on_deadline(self) -> None:
        if self.closed:
            return
        self.timer = None
        batch = self.coalescer.due(time.time_ns())
        if batch is not None:
            self._send(batch)
        self._arm_timer()

    def _send(self, batch: TokenBatch) -> None:
        if self._held is not None:  # not cleared to publish yet
            self._held.append(batch)
            return
        if self.refused:
            if batch.is_final:
                self._finish(batch)
            return
        # Msg-Id per (stream, seq, writer): a retry of this writer's append is recognised as its own.
        headers = {**self.headers, "Nats-Msg-Id": f"{self.owner}:{batch.id}:{batch.seq}:{self._tag}"}
        if self.ctx.worker and not self._said_served:  # this delivery's first: who serves it (the inspector)
            headers[SERVED_BY_HEADER] = self.ctx.worker
            self._said_served = True
        self.timeline.on_batch(self.ctx.metrics, batch, batch.timings["emitted"])  # set by the coalescer
        self.ctx.publisher.publish(self.chain, batch.encode(), headers)
        if batch.is_final:
            self._finish(batch)

    def _finish(self, batch: TokenBatch) -> None:
        self.closed = True
        self._cancel_timer()
        if self.refused:
            self.span.end()
        else:
            self.timeline.finish(self.ctx.metrics, self.ctx.tracer, self.span, batch)
        if self.msg is not None:
            self.ctx.publisher.ack_after_published(self.chain, self.msg)
        self.ctx.finished(self, batch)
