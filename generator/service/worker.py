"""The generator worker: its lifecycle, taking requests when slots are free, and cancelling them.

It takes the requests :class:`RequestIntake` pulls for the free slots
(continuing redelivered ones from their published history), hands them to the engine
(an :class:`~generator.engine.handle.EngineHandle`: the :class:`Runner` thread, or the engine-core
process), and routes what comes back to each request's
:class:`~generator.service.writer.StreamWriter` (coalescing, publishing, the ack).
:class:`~generator.service.announce.Announcer` makes the worker known to the relays.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider

from tokenpipe.append import StreamLost
from tokenpipe.background import pause, stop_loops
from tokenpipe.bus import REPAIR_INTERVAL_S, Bus, release_intake, repair
from tokenpipe.errors import InvalidRequest, RateLimited, TokenpipeError, WireFormatError
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.quota import TokenRate, fair_owner, request_cost
from tokenpipe.settings import Settings, engine_threads
from tokenpipe.streams import history_at, id_taken
from tokenpipe.subjects import (
    CANCEL_WILDCARD,
    RELAY_OWNER,
    REQUESTS_STREAM,
    owner_of_request,
    parse_cancel_subject,
    slot_of_request,
    stream_key,
)
from tokenpipe.telemetry import extract_context, get_tracer
from tokenpipe.wire import Cancel, Request, TokenBatch, Usage

from ..engine.handle import Emission, EngineHandle, Job
from ..engine.process import EngineProcess
from ..engine.runner import FirstBatchGate, Runner
from ..model.loader import LoadedModel
from .announce import Announcer
from .intake import RequestIntake, keep, patiently
from .placed import SlotPulls, Summary, slot_for
from .publisher import BatchPublisher
from .rescue import Rescuer
from .writer import OutputContext, StreamWriter

__all__ = ["GeneratorWorker"]

log = logging.getLogger(__name__)

# The engine's longest wait for new streams' first batches to go out live (FirstBatchGate): a
# PubAck takes ~0.3 ms on an idle machine, a few ms on two busy cores; past this the step goes on.
FIRST_BATCH_WAIT_S = 0.005
# Requests a generator holding batch work pulls beyond its slots (see GeneratorWorker.free_slots).
LOOKAHEAD = 4
_CHECK_WAIT_S = 5.0  # at most this long a stopping worker waits for the stream-id checks in flight


class GeneratorWorker:
    """Serve one model from NATS until :meth:`stop` is called."""

    def __init__(self, settings: Settings, loaded: LoadedModel, bus: Bus,
                 tracer_provider: TracerProvider | None = None, torch_thread: Executor | None = None,
                 engine_process: EngineProcess | None = None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.model = loaded.name
        self.bus = bus
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())
        self.metrics = GeneratorMetrics(loaded.name)
        self.metrics.labels(self.metrics.engine_threads).set(engine_threads(settings.threads))
        # The engine thread calls it once a step (prometheus_client is thread-safe).
        on_step: Callable[[int], None] = self.metrics.labels(self.metrics.batch_size).observe
        self.runner: EngineHandle
        thread: Runner | None = None
        if engine_process is None:
            self.runner = thread = Runner.for_settings(loaded, settings, self._from_engine_thread, on_step=on_step,
                                                       torch_thread=torch_thread)
        else:  # the engine runs in its own process (generator.engine.process), already loaded
            engine_process.on_emit, engine_process.on_step = self._from_engine_thread, on_step
            self.runner = engine_process
        # The requests this worker holds, by stream key (tokenpipe.subjects.stream_key: owner and id).
        self.active: dict[str, StreamWriter] = {}
        # Each owner's latest cancels (at most settings.cancel_memory of its ids): a cancel that came
        # before its request still cancels it, and one owner's flood of cancels forgets only its own.
        self.recent_cancels: dict[str, OrderedDict[str, None]] = {}
        # Tokens per minute of each application on the bus (the relay's tenants are charged at the relay).
        self.token_rate = TokenRate(settings.owner_tokens_per_min)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()  # no more fetching; running requests may still finish
        self._closing = asyncio.Event()  # the background loops end (after the drain)
        self.publisher = BatchPublisher(bus)
        if thread is not None and loaded.device.type == "cpu" and settings.first_batch_hold_ms > 0:
            thread.first_batches = FirstBatchGate(FIRST_BATCH_WAIT_S, settings.first_batch_hold_ms / 1000)
            self.publisher.on_live = thread.first_batches.sent
        self.intake = RequestIntake(bus, loaded.name, settings, live=self.publisher.live)
        self.announcer = Announcer(bus, settings, worker_id=self.worker_id, model=self.model,
                                   device=str(loaded.device), runner=self.runner, streams=self._held,
                                   metrics=self.metrics)
        self.rescuer = Rescuer(bus, settings, worker_id=self.worker_id, model=self.model,
                               held=self._held_deliveries, progress_every=self.progress_every)
        slot = slot_for(settings, socket.gethostname())
        self.summary = Summary(bus, settings, worker_id=self.worker_id, model=self.model, slot=slot,
                               load=lambda: (self.runner.running, len(self.active) - self.runner.running))
        self.slot_pulls = SlotPulls(bus, settings, model=self.model, slot=slot, room=self._room,
                                    wanted_own=self._wanted_own, deliver=self._arrived)
        self._output = OutputContext(settings, self.publisher, self.metrics, self.tracer, self._finished, self._lost,
                                     worker=self.worker_id)
        self._tasks: list[asyncio.Task[None]] = []
        self._checks: set[asyncio.Task[None]] = set()  # stream-id checks of first deliveries still running
        self._cancels: Subscription | None = None

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.runner.start()
        try:
            await self.publisher.start()
            await self.intake.subscribe()
            await self.slot_pulls.start()
        except BaseException:
            # The engine runs on a non-daemon thread: a start that failed here (JetStream not
            # answering yet, a cluster still forming) kept the process alive, never ready and
            # never restarted by `tokenpipe up` (seen in the chaos run).
            await asyncio.to_thread(self.runner.stop)
            raise
        self._cancels = await self.bus.nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel)
        self._tasks = [
            asyncio.create_task(self._fetch_loop(), name="fetch"),
            asyncio.create_task(self._progress_loop(), name="progress"),
            asyncio.create_task(self._repair_loop(), name="repair"),
        ]
        await self.announcer.start()
        await self.rescuer.start()
        await self.summary.start()
        log.info("generator ready", extra={"model": self.model, "worker": self.worker_id,
                                           "max_batch": self.settings.max_batch, "device": str(self.loaded.device)})

    async def stop(self, drain_timeout: float = 10.0) -> None:
        """Stop fetching, let running requests finish for ``drain_timeout``, NAK the rest."""
        self._stopping.set()
        self._slot_freed.set()
        await self.slot_pulls.stop()
        try:
            await self._hand_back_waiting()
            await self._hand_back(drain_timeout)
        finally:
            # Always: the engine runs on a non-daemon thread that would keep the process alive.
            await asyncio.to_thread(self.runner.stop)
        await self.bus.nc.flush()

    async def _hand_back_waiting(self) -> None:
        """What waits here unstarted (the waiting room) goes back to the queue at once, for another
        generator to take now, not started by the drain only to be cut at its end. Nothing of it was
        published (its emissions, if the engine admitted it meanwhile, are dropped with it); one whose
        stream-id check has not answered yet stays for :meth:`_hand_back`."""
        waiting = [(out, out.msg) for out in self.active.values()
                   if not out.started and out.checked and out.msg is not None]
        for out, _ in waiting:
            self.runner.cancel(out.key)
            out.abandon()
            self.active.pop(out.key, None)
        for _, msg in waiting:
            await msg.nak()
        if waiting:
            log.info("handed back waiting requests", extra={"count": len(waiting)})

    async def _hand_back(self, drain_timeout: float) -> None:
        deadline = time.monotonic() + drain_timeout
        while self.active and time.monotonic() < deadline:
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=deadline - time.monotonic())
            except TimeoutError:
                break
        if self._checks:
            # A request is not handed back before its id check answered: a redelivery is not checked
            # again (it continues the stream's history), so an unchecked one could append to a taken id.
            await asyncio.wait(list(self._checks), timeout=_CHECK_WAIT_S)
        handed_back = list(self.active.values())
        for out in handed_back:
            self.runner.cancel(out.key)
            out.abandon()  # emissions still in flight for it are dropped, unpublished
        self.active.clear()
        for check in list(self._checks):
            check.cancel()  # what it guarded was abandoned: its batches are never published
        # Every batch already handed to the publisher must be stored before another worker reads the stream.
        await self.publisher.flush()
        for out in handed_back:
            if out.msg is not None:
                await out.msg.nak()
        if handed_back:
            log.info("handed back unfinished requests", extra={"count": len(handed_back)})
        await self.announcer.stop()
        await self.rescuer.stop()
        await self.summary.stop()
        await stop_loops(self._closing, self._tasks)  # not by cancel alone: see tokenpipe.background
        await self.publisher.close()
        if self._cancels is not None:
            await self._cancels.unsubscribe()
        await self.intake.close()
        await self.slot_pulls.close()

    @property
    def serving(self) -> bool:
        """Started, not stopping, and connected to NATS (the generator's ``/readyz``)."""
        return bool(self._tasks) and not self._stopping.is_set() and self.bus.nc.is_connected

    def _held(self) -> list[tuple[str, str]]:
        """``(owner, id)`` of the streams held now (the announcements count them all and name the
        relay's: operators and tests find an HTTP stream's holder by its id)."""
        return [(out.owner, out.request.id) for out in self.active.values()]

    def _held_deliveries(self) -> list[Msg]:
        """The deliveries of the requests held now (published for the peers: generator.service.rescue)."""
        return [out.msg for out in self.active.values() if out.msg is not None]

    # -- intake ----------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Requests to pull: below ``max_batch``, as many as the KV cache's free blocks can take;
        while batch work runs here, :data:`LOOKAHEAD` more; and up to ``waiting_room`` held waiting.

        The waiting room is for fair share: the queue is one FIFO per model, so another owner's
        request behind one owner's backlog is seen only once the backlog ahead of it is pulled. Held
        here, the engine admits from it by fair share between owners (generator.engine.scheduler)
        and preempts a row of the owner over its share for it.

        The queue is one FIFO per model, so an interactive request is seen only once the requests
        ahead of it are pulled. Pulling the whole backlog to find it would hold batch work here that
        other generators could run, each delivery kept alive by progress acks; pulling only for free
        slots would leave it queued behind running batch rows until one of them finished. The
        lookahead lets a generator whose slots run batch work take a few requests more: an
        interactive one among them preempts a batch row (generator.engine.scheduler), and what it
        holds beyond its slots stays bounded by ``LOOKAHEAD``."""
        room = self._room()
        # Held and not running: waiting in the engine (or on their way to it).
        waiting = len(self.active) - self.runner.running
        return room if room > 0 else max(room, self.settings.waiting_room - waiting)

    def _room(self) -> int:
        """Requests it can start now: free slots the KV cache can take, and the batch lookahead."""
        room = min(self.settings.max_batch - len(self.active), self.runner.memory_room)
        batch = sum(1 for out in self.active.values() if out.request.batch)
        # More batch requests held than could all be waiting beyond the slots: one of them runs, and
        # an interactive request pulled now can take its row.
        if batch > max(len(self.active) - self.settings.max_batch, 0):
            room += LOOKAHEAD
        return room

    def _wanted_own(self) -> int:
        """Requests to pull from its own placement slot: while a peer has idle capacity, only those it can
        start now (the rest go to that peer at once: tokenpipe.slots); else into its waiting room too,
        where fair share between owners orders them."""
        if self._stopping.is_set():
            return 0
        idle_peer = self.summary.peers.idle_elsewhere(self.model, self.worker_id)
        return min(self._room() if idle_peer else self.free_slots, LOOKAHEAD * 2)

    def _burst_share(self, pending: int) -> int:
        """Of ``pending`` requests queued behind one just pulled, how many to pull too: all that fit,
        unless peers have idle capacity; then a part in proportion to this one's room, so that a burst is
        started on every generator at once (32 streams arriving together ran 30 on one of two)."""
        peers = self.summary.peers.free_elsewhere(self.model, self.worker_id)
        room = max(self._room(), 0)
        if peers <= 0:
            return pending
        return -(-pending * room // (room + peers))  # rounded up: with room, at least one

    async def _arrived(self, msgs: list[Msg]) -> None:
        """Requests pulled (from the shared queue or a placement slot): start each."""
        await self.rescuer.arrived(msgs)
        # All but the last of a burst are flagged: an idle engine holds its first prefill
        # (at most admission_hold_ms) so that the burst is prefilled together.
        for i, msg in enumerate(msgs):
            if self._stopping.is_set():
                await msg.nak()  # fetched while stopping: hand it straight back
            else:
                await self._accept(msg, more_coming=i < len(msgs) - 1)
        self.slot_pulls.wake()

    async def _fetch_loop(self) -> None:
        while not self._stopping.is_set():
            if self.free_slots <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                msgs = await self.intake.next_burst(lambda: self.free_slots, self._stopping, self._burst_share)
            except TimeoutError:
                continue
            except Exception as exc:  # reconnects and server restarts surface here; retry
                if self._stopping.is_set():
                    return
                log.warning("fetch failed; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)
                continue
            await self._arrived(msgs)

    async def _check_id(self, out: StreamWriter, msg: Msg) -> None:
        """A first delivery starts a new stream: unless its id already has token history (then it
        is refused: nobody appends to a running or finished stream by reusing its id). This runs
        while the engine already works on the request (the lookup is a round trip off the first
        token's path); nothing of it is published before the id is known to be free."""
        rid = out.request.id
        try:
            # Waited out while JetStream is between leaders, the delivery kept: a nak would spend
            # one of the request's few delivery attempts on an outage that is not its fault.
            taken = await patiently(lambda: id_taken(self.bus, rid, owner=out.owner), what="checking a stream id",
                                    request_id=rid, msg=msg)
        except TokenpipeError as exc:
            if out.closed:
                return  # handed back meanwhile
            log.warning("cannot check the stream id; retrying later", extra={"request_id": rid, "error": exc.message})
            self._refuse(out)
            await msg.nak(delay=1.0)
            return
        if out.closed:
            return
        if not taken:  # the id is free (junk on its subject does not take it: the first append goes after it)
            out.clear()
            return
        log.warning("refusing a request for a stream id that is taken", extra={"request_id": rid, "owner": out.owner})
        self._refuse(out)
        await release_intake(self.bus.js, msg.subject, msg.headers)  # before: tokenpipe.bus.release_intake
        await msg.term()  # no error batch: that stream belongs to its first request

    def _refuse(self, out: StreamWriter) -> None:
        """Nothing of ``out`` is published; its slot is free once the engine has let it go."""
        out.refuse()
        self.runner.cancel(out.key)

    async def _accept(self, msg: Msg, *, more_coming: bool = False) -> None:
        received = time.time_ns()
        try:
            request = Request.decode(msg.data)
            owner = owner_of_request(msg.subject)  # who published it: never taken from the payload
        except TokenpipeError as exc:  # undecodable too: an id that can still be read from it is told
            await self.intake.reject(msg, exc)
            return
        key = stream_key(owner, request.id)  # another owner's stream of the same id is another stream
        if key in self.active:
            # Redelivered while we still run it (a late progress ack): keep it ours, do not ack it away.
            await msg.in_progress()
            return
        if request.prompt_chars > self.settings.max_prompt_chars:
            # Refused before its prompt reaches the tokenizer: encoding ~1 MB took the engine from every stream.
            await self.intake.reject(msg, InvalidRequest(
                f"the prompt exceeds {self.settings.max_prompt_chars} characters",
                param="messages" if request.messages is not None else "prompt"))
            return
        if owner != RELAY_OWNER and msg.metadata.num_delivered == 1:  # a redelivery was charged already;
            # the relay's requests were charged at the relay, to their tenants
            try:
                self.token_rate.charge(owner, request_cost(request.params.max_tokens, request.prompt_chars))
            except RateLimited as exc:
                await self.intake.reject(msg, exc)
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
        past: list[TokenBatch] = []
        stored_last = 0  # the stream's last stored sequence: the first append is conditional on it
        if msg.metadata.num_delivered > 1:
            # Redelivered: a worker died, handed it back, or stalled (it may still be writing: its
            # appends and ours are conditional, the store takes one writer's). Continue after what is stored.
            try:
                past, stored_last = await patiently(lambda: history_at(self.bus, request.id, owner=owner),
                                                    what="reading history", request_id=request.id, msg=msg)
            except TokenpipeError as exc:
                log.warning("cannot read history; retrying later", extra={"request_id": request.id,
                                                                          "error": exc.message})
                span.end()
                await msg.nak(delay=1.0)
                return
            if past and past[-1].is_final:
                span.end()
                await release_intake(self.bus.js, msg.subject, msg.headers)
                await msg.ack()  # it finished; only the ack was lost
                return
        resume = tuple(t for b in past for t in b.token_ids)
        span.set_attribute("tokenpipe.delivery", msg.metadata.num_delivered)
        span.set_attribute("tokenpipe.resumed_tokens", len(resume))
        first = msg.metadata.num_delivered == 1
        out = self.active[key] = StreamWriter(self._output, request, msg, span, past=past,
                                                      stored_last=stored_last, received=received,
                                                      owner=owner, cleared=not first)
        self.rescuer.changed()
        if past:
            log.info("continuing redelivered request", extra={"request_id": request.id, "resumed_tokens": len(resume),
                                                              "delivery": msg.metadata.num_delivered})
        if first:
            check = asyncio.get_running_loop().create_task(self._check_id(out, msg), name=f"check-{request.id}")
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)
        if request.id in self.recent_cancels.get(owner, ()):
            out.emit(Emission(key, (), "", time.time_ns(), finish="cancelled", usage=Usage(0, len(resume))))
            return
        self.runner.submit(Job(request, resume_ids=resume, more_coming=more_coming, key=key))
        self.summary.record(request, owner)
        slot = slot_of_request(msg.subject)
        how = "shared" if slot is None else "own" if slot == self.summary.slot else "taken"
        self.metrics.placed.labels(model_name=self.model, how=how).inc()

    # -- cancellation ----------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        """Act only on a well-formed cancel of the subject's stream by the subject's owner (the
        accounts make the subject the owner's; the payload check drops whatever else lands there)."""
        try:
            owner, rid = parse_cancel_subject(msg.subject)
            order = Cancel.decode(msg.data)
            if (order.owner, order.id) != (owner, rid):
                raise WireFormatError(f"the cancel names {order.owner}.{order.id}")
        except TokenpipeError as exc:
            log.warning("cancel dropped", extra={"subject": msg.subject, "error": exc.message})
            self.metrics.labels(self.metrics.dropped_cancels).inc()
            return
        remembered = self.recent_cancels.setdefault(owner, OrderedDict())
        remembered[rid] = None
        remembered.move_to_end(rid)
        while len(remembered) > self.settings.cancel_memory:
            remembered.popitem(last=False)
        key = stream_key(owner, rid)
        if key in self.active:
            log.info("cancel requested", extra={"request_id": rid, "owner": owner})
            self.runner.cancel(key)

    @property
    def progress_every(self) -> float:
        """Seconds between in-progress acks. A short ``ack_wait`` makes a dead worker's requests move
        on quickly; these acks keep a live worker's requests its own. The slack is ``ack_wait`` minus
        this: an event loop stalled longer than that (GC, a busy CPU) loses its requests."""
        return max(min(self.settings.progress_interval_s, self.settings.ack_wait_s / 3), 0.05)

    async def _progress_loop(self) -> None:
        """Tell JetStream that every held request is still in progress (before ``ack_wait`` runs out)."""
        # a fixed cadence, not an event: the point is the clock (and on through the drain)
        while await pause(self._closing, self.progress_every):
            for out in list(self.active.values()):
                if out.msg is not None:
                    await keep(out.msg, out.request.id)
            for key, msg in list(self.publisher.unacked.items()):  # finished, its last batches still being stored
                if key not in self.active:
                    await keep(msg, key)
            self._count_owners()

    def _count_owners(self) -> None:
        """Each owner's running and waiting requests here, into the gauges (a request runs from its
        first token on; one preempted meanwhile still counts as running)."""
        counts: dict[str, tuple[int, int]] = {}
        for out in self.active.values():
            owner = fair_owner(out.owner, out.request.tenant)
            running, waiting = counts.get(owner, (0, 0))
            started = bool(out.timeline.first_token or out.timeline.admitted)
            counts[owner] = (running + started, waiting + (not started))
        self.metrics.set_owners(counts)

    async def _repair_loop(self) -> None:
        """Re-provision the streams and bucket when someone deleted them; a new ``TP_REQUESTS``
        also needs the consumer again."""
        lost = False
        while await pause(self._closing, REPAIR_INTERVAL_S):
            if not self.bus.nc.is_connected:
                continue  # reconnecting: nothing to ask yet
            try:
                gone = await repair(self.bus.js, self.settings, registry=self.bus.registry,
                                    provision_streams=self.bus.provisions)
                lost = lost or REQUESTS_STREAM in gone
                # Re-created by us just now, or (where only the admin provisions) once it is back.
                if lost and (self.bus.provisions or REQUESTS_STREAM not in gone):
                    await self.intake.resubscribe()
                    lost = False
            except Exception as exc:  # JetStream recovering or unreachable: the next round tries again
                log.warning("JetStream check failed", extra={"error": repr(exc)})

    # -- output ----------------------------------------------------------------------
    def _from_engine_thread(self, emissions: list[Emission]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_emissions, emissions)

    def _on_emissions(self, emissions: list[Emission]) -> None:
        for em in emissions:
            out = self.active.get(em.request_id)  # the job's key: the stream's
            if out is None:
                continue  # finished, or handed back while this step ran
            try:
                out.emit(em)
            except Exception:  # one stream's failure must not drop the others' tokens of this step
                log.exception("emission failed", extra={"request_id": em.request_id})

    def _lost(self, out: StreamWriter, exc: StreamLost) -> None:
        """The store refused one of ``out``'s appends: another worker holds the stream now (its
        request was redelivered while this one stalled). Stop generating it at once and free the slot."""
        self.metrics.labels(self.metrics.lost_streams).inc()
        log.warning("lost a stream to another writer; stopped generating it",
                    extra={"request_id": out.request.id, "owner": out.owner, "error": exc.message})
        if self.active.get(out.key) is out:
            self.active.pop(out.key)
            self.rescuer.changed()
            self.runner.cancel(out.key)
            self._freed()

    def _freed(self) -> None:
        """A slot is free: the fetch loop and the slot pulls may pull again, and the summary says so."""
        self._slot_freed.set()
        self.slot_pulls.wake()
        self.summary.changed()

    def _finished(self, out: StreamWriter, batch: TokenBatch) -> None:
        rid = out.request.id
        if self.active.get(out.key) is out:
            self.active.pop(out.key)
            self.rescuer.changed()
        self._freed()
        if out.refused:
            return
        log.info("request finished", extra={"request_id": rid, "finish": batch.finish,
                                            "tokens": batch.usage.completion_tokens if batch.usage else 0})
