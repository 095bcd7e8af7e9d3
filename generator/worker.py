"""The generator's NATS adapter: take requests when slots are free, publish coalesced batches.

With :mod:`generator.intake` and :mod:`generator.publisher`, the only generator modules
that import nats. It takes the requests :class:`RequestIntake` pulls for the free slots
(continuing redelivered ones from their published history), hands them to the
:class:`Runner` thread, coalesces what comes back, and passes each batch to the
:class:`BatchPublisher` for ``tp.tok.<id>``; the request is acked once its final batch is
stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider

from tokenpipe.bus import Bus
from tokenpipe.errors import TokenpipeError, WireFormatError
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.streams import history
from tokenpipe.subjects import (
    ANNOUNCE_PREFIX,
    CANCEL_WILDCARD,
    DISCOVER_SUBJECT,
    REQUESTS_STREAM,
    consumer_name,
    token_subject,
)
from tokenpipe.telemetry import extract_context, get_tracer, inject_headers
from tokenpipe.wire import Request, TokenBatch, Usage

from .coalesce import Coalescer
from .intake import RequestIntake
from .models import LoadedModel
from .observe import Timeline
from .publisher import BatchPublisher
from .runner import Emission, Job, Runner

__all__ = ["GeneratorWorker"]

log = logging.getLogger(__name__)

_RECENT_CANCELS = 10_000


@dataclass
class _Active:
    msg: Msg | None
    request: Request
    coalescer: Coalescer
    span: Any
    timeline: Timeline
    headers: dict[str, str] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None


class GeneratorWorker:
    """Serve one model from NATS until :meth:`stop` is called."""

    def __init__(self, settings: Settings, loaded: LoadedModel, bus: Bus,
                 tracer_provider: TracerProvider | None = None, worker_id: str | None = None,
                 metrics: GeneratorMetrics | None = None, torch_thread: Executor | None = None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.model = loaded.name
        self.bus = bus
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.metrics = metrics or GeneratorMetrics(loaded.name)
        self.runner = Runner(loaded, self._from_engine_thread, on_step=self._on_step, max_batch=settings.max_batch,
                             max_seq_len=settings.max_seq_len, prefill_token_budget=settings.prefill_token_budget,
                             max_prompt_tokens=settings.max_prompt_tokens, torch_thread=torch_thread,
                             admission_hold_s=settings.admission_hold_ms / 1000)
        self.active: dict[str, _Active] = {}
        self.recent_cancels: OrderedDict[str, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        # (subject, payload, headers) to publish, or ("", b"", msg) to ack once what precedes is out
        self.publisher = BatchPublisher(bus)
        self.intake = RequestIntake(bus, loaded.name, settings)
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self.completed = 0

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.runner.start()
        self.publisher.start()
        nc = self.bus.nc
        await self.intake.subscribe()
        self._subs.append(await nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel))
        self._subs.append(await nc.subscribe(DISCOVER_SUBJECT, cb=self._on_discover))
        self._tasks = [
            asyncio.create_task(self._fetch_loop(), name="fetch"),
            asyncio.create_task(self._keepalive_loop(), name="keepalive"),
        ]
        await self._announce()
        log.info("generator ready", extra={"model": self.model, "worker": self.worker_id,
                                           "max_batch": self.settings.max_batch, "device": str(self.loaded.device)})

    async def stop(self, drain_timeout: float = 10.0) -> None:
        """Stop fetching, let running requests finish for ``drain_timeout``, NAK the rest."""
        self._stopping.set()
        self._slot_freed.set()
        try:
            await self._hand_back(drain_timeout)
        finally:
            # Always: the engine runs on a non-daemon thread that would keep the process alive.
            await asyncio.to_thread(self.runner.stop)
        await self.bus.nc.flush()

    async def _hand_back(self, drain_timeout: float) -> None:
        deadline = time.monotonic() + drain_timeout
        while self.active and time.monotonic() < deadline:
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=deadline - time.monotonic())
            except TimeoutError:
                break
        handed_back = list(self.active.values())
        for act in handed_back:
            self.runner.cancel(act.request.id)
            act.span.end()
        self.active.clear()  # emissions still in flight for these are dropped, unpublished
        # Everything already coalesced must be in the stream before another worker reads it.
        await self.publisher.flush()
        for act in handed_back:
            if act.msg is not None:
                await act.msg.nak()
        if handed_back:
            log.info("handed back unfinished requests", extra={"count": len(handed_back)})
        await self._announce(ready=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.publisher.close()
        for sub in self._subs:
            await sub.unsubscribe()
        await self.intake.close()

    # -- intake ----------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.settings.max_batch - len(self.active)

    async def _fetch_loop(self) -> None:
        while not self._stopping.is_set():
            free = self.free_slots
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                msgs = await self.intake.next_burst(lambda: self.free_slots, self._stopping)
            except TimeoutError:
                continue
            except Exception as exc:  # reconnects and server restarts surface here; retry
                if self._stopping.is_set():
                    return
                log.warning("fetch failed; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)
                continue
            # All but the last of a burst are flagged: an idle engine holds its first prefill
            # (at most admission_hold_ms) so that the burst is prefilled together.
            for i, msg in enumerate(msgs):
                if self._stopping.is_set():
                    await msg.nak()  # fetched while stopping: hand it straight back
                else:
                    await self._accept(msg, more_coming=i < len(msgs) - 1)

    async def _accept(self, msg: Msg, *, more_coming: bool = False) -> None:
        received = time.time_ns()
        try:
            request = Request.decode(msg.data)
        except WireFormatError as exc:
            await self.intake.reject_undecodable(msg, exc)
            return
        except TokenpipeError as exc:
            await self.intake.reject(msg, exc)
            return
        if request.id in self.active:
            # Redelivered while we still run it (a late progress ack): keep it ours, do not ack it away.
            await msg.in_progress()
            return
        ctx = extract_context(msg.headers)
        span = self.tracer.start_span(f"generate {self.model}", context=ctx, kind=SpanKind.CONSUMER, attributes={
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.destination.name": msg.subject,
            "gen_ai.operation.name": "text_completion" if request.prompt is not None else "chat",
            "gen_ai.request.model": request.model,
            "gen_ai.request.max_tokens": request.params.max_tokens,
            "gen_ai.request.temperature": request.params.temperature,
            "tokenpipe.stream.id": request.id,
        })
        headers = inject_headers(span=span)
        past: list[TokenBatch] = []
        if msg.metadata.num_delivered > 1:
            # Redelivered: a worker died or handed it back. Continue after what it published.
            try:
                past = await history(self.bus, request.id)
            except TokenpipeError as exc:
                log.warning("cannot read history; retrying later", extra={"request_id": request.id,
                                                                          "error": exc.message})
                span.end()
                await msg.nak(delay=1.0)
                return
            if past and past[-1].is_final:
                span.end()
                await msg.ack()  # it finished; only the ack was lost
                return
        resume = tuple(t for b in past for t in b.token_ids)
        span.set_attribute("tokenpipe.delivery", msg.metadata.num_delivered)
        span.set_attribute("tokenpipe.resumed_tokens", len(resume))
        co = request.coalesce
        coalescer = Coalescer(
            request.id,
            max_tokens=co.max_tokens if co.max_tokens is not None else self.settings.coalesce_max_tokens,
            max_delay_ns=int(1e6 * (co.max_delay_ms if co.max_delay_ms is not None
                                    else self.settings.coalesce_max_delay_ms)),
            start_seq=past[-1].seq + 1 if past else 0,
            start_index=len(resume),
            first_timings={"created": request.created_at, "received": received},
        )
        timeline = Timeline(created=request.created_at, received=received, resumed_tokens=len(resume))
        self.active[request.id] = _Active(msg, request, coalescer, span, timeline, headers)
        if past:
            log.info("continuing redelivered request", extra={"request_id": request.id, "resumed_tokens": len(resume),
                                                              "delivery": msg.metadata.num_delivered})
        if request.id in self.recent_cancels:
            self._emit_now(request.id, Emission(request.id, (), "", time.time_ns(), finish="cancelled",
                                                usage=Usage(0, len(resume))))
            return
        self.runner.submit(Job(request, resume_ids=resume, received_ns=received, more_coming=more_coming))

    # -- cancellation & discovery ----------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        self.recent_cancels[rid] = None
        while len(self.recent_cancels) > _RECENT_CANCELS:
            self.recent_cancels.popitem(last=False)
        if rid in self.active:
            log.info("cancel requested", extra={"request_id": rid})
            self.runner.cancel(rid)

    async def _on_discover(self, msg: Msg) -> None:
        if msg.reply:
            await self.bus.nc.publish(msg.reply, self._announcement(True))

    def _announcement(self, ready: bool) -> bytes:
        return json.dumps({
            "worker": self.worker_id,
            "model": self.model,
            "ready": ready,
            "max_batch": self.settings.max_batch,
            "running": self.runner.running,
            "active": len(self.active),
            "pid": os.getpid(),
            "streams": sorted(self.active),  # which worker holds which stream, for operators and tests
            "device": str(self.loaded.device),
            "ttl_s": self.settings.announce_interval_s * 3,
            "ts": time.time(),
        }).encode()

    async def _announce(self, ready: bool = True) -> None:
        await self.bus.nc.publish(f"{ANNOUNCE_PREFIX}.{self.worker_id}", self._announcement(ready))

    async def _keepalive_loop(self) -> None:
        """Announce ourselves and tell JetStream long requests are still in progress."""
        progress_every = max(self.settings.ack_wait_s / 3, 0.5)
        last_progress = time.monotonic()
        while True:
            await asyncio.sleep(min(self.settings.announce_interval_s, progress_every))
            try:
                await self._announce()
                await self._refresh_gauges()
            except Exception as exc:  # an outage must not end the announcements for good
                log.warning("announce failed", extra={"error": repr(exc)})
            if time.monotonic() - last_progress >= progress_every:
                last_progress = time.monotonic()
                for act in list(self.active.values()):
                    if act.msg is None:
                        continue
                    try:
                        await act.msg.in_progress()
                    except Exception as exc:  # one failure must not starve the other requests' progress acks
                        log.warning("in-progress ack failed", extra={"request_id": act.request.id,
                                                                     "error": repr(exc)})

    def _on_step(self, batch_size: int) -> None:
        """Engine thread, once per step (prometheus_client is thread-safe)."""
        m = self.metrics
        m.labels(m.batch_size).observe(batch_size)

    async def _refresh_gauges(self) -> None:
        m, engine = self.metrics, self.runner.engine
        m.labels(m.running).set(self.runner.running)
        used = sum(s.next_position for s in list(engine.rows))
        m.labels(m.kv_cache).set(used / (engine.max_batch * engine.max_seq_len))
        try:
            info = await self.bus.js.consumer_info(REQUESTS_STREAM, consumer_name(self.model))
            m.labels(m.waiting).set(int(info.num_pending or 0))
        except Exception as exc:  # a reconnect in progress; the next round catches up
            log.debug("consumer info unavailable", extra={"error": repr(exc)})

    # -- output ----------------------------------------------------------------------
    def _from_engine_thread(self, emissions: list[Emission]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_emissions, emissions)

    def _on_emissions(self, emissions: list[Emission]) -> None:
        for em in emissions:
            try:
                self._emit_now(em.request_id, em)
            except Exception:  # one stream's failure must not drop the others' tokens of this step
                log.exception("emission failed", extra={"request_id": em.request_id})

    def _emit_now(self, rid: str, em: Emission) -> None:
        act = self.active.get(rid)
        if act is None:
            return
        if em.admitted_ns:
            act.coalescer.first_timings["admitted"] = em.admitted_ns
            act.timeline.admitted = em.admitted_ns
        if em.token_ids:
            act.timeline.on_token(self.metrics, em.at_ns)
        batch = act.coalescer.add(list(em.token_ids), em.text, em.at_ns, finish=em.finish, error=em.error,
                                  usage=em.usage, error_code=em.error_code)
        if batch is not None:
            self._send(act, batch)
        self._arm_timer(rid, act)

    def _arm_timer(self, rid: str, act: _Active) -> None:
        if act.timer is not None:
            act.timer.cancel()
            act.timer = None
        deadline = act.coalescer.deadline()
        if deadline is not None and self._loop is not None:
            delay = max(0.0, (deadline - time.time_ns()) / 1e9)
            act.timer = self._loop.call_later(delay, self._on_deadline, rid)

    def _on_deadline(self, rid: str) -> None:
        act = self.active.get(rid)
        if act is None:
            return
        act.timer = None
        batch = act.coalescer.due(time.time_ns())
        if batch is not None:
            self._send(act, batch)
        self._arm_timer(rid, act)

    def _send(self, act: _Active, batch: TokenBatch) -> None:
        # Msg-Id per (stream, seq): should two workers ever publish the same batch, JetStream keeps one.
        headers = {**act.headers, "Nats-Msg-Id": f"{batch.id}:{batch.seq}"}
        act.timeline.on_batch(self.metrics, batch, batch.timings.get("emitted", time.time_ns()))
        self.publisher.publish(token_subject(batch.id), batch.encode(), headers)
        if batch.is_final:
            self._finish(act, batch)

    def _finish(self, act: _Active, batch: TokenBatch) -> None:
        rid = act.request.id
        self.active.pop(rid, None)
        if act.timer is not None:
            act.timer.cancel()
        act.timeline.finish(self.metrics, self.tracer, act.span, batch)
        self.completed += 1
        if act.msg is not None:
            self.publisher.ack_after_published(act.msg)
        self._slot_freed.set()
        log.info("request finished", extra={"request_id": rid, "finish": batch.finish,
                                            "tokens": batch.usage.completion_tokens if batch.usage else 0})

