"""The engine's thread: jobs in, per-step emissions out. No transport here.

The engine is used only from this thread. Callers hand over jobs and cancellations
(thread-safe) and receive, once per engine step, a list of :class:`Emission` through
``on_emit`` (called on this thread; the NATS worker hops it onto its event loop).
While the engine is idle, this thread also measures the
model's kernel table where a start left it pending (:mod:`generator.model.tuning`), a unit at a time.
A job's prompt is encoded first on a thread of its own (the tokenizer thread): a long prompt's
encoding took the engine thread away from every running stream's steps. Cancellations go the same
way, so each still follows the jobs handed over before it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Unpack

from tokenpipe.errors import InvalidRequest, TokenpipeError
from tokenpipe.quota import fair_owner, parse_weights, weight_of
from tokenpipe.settings import Settings
from tokenpipe.wire import FinishReason, Request, Usage

from ..model.autotune import release_freed_memory
from ..model.kvcache import BLOCK_SIZE
from ..model.loader import LoadedModel
from .detok import IncrementalDetokenizer, StopMatcher
from .handle import Emission, EngineHandle, EngineStats, Job
from .scheduler import Engine, EngineArgs, Sequence, StepOutput

__all__ = ["FirstBatchGate", "Runner", "encode_prompt", "torch_thread"]

log = logging.getLogger(__name__)

IDLE_TRIM_S = 2.0  # an engine idle this long after work hands the heap it grew back to the system


class FirstBatchGate:
    """After a step that produced streams' first tokens, the engine thread waits (at most
    ``limit_s``) until the worker has sent those streams' first batches live, then ``hold_s`` more.

    On a CPU the engine's thread team holds every core through the next step, while a first batch
    needs the worker's event loop twice (to append it, and after its PubAck to send its live copy),
    then nats-server and the relay. Given the cores for that moment, that hop took half as long
    (measured on 2 cores); a step that starts new streams is followed by
    a pause of a few milliseconds. Waiting for the live copy alone, without the hold, did not help
    reliably: the copy is then still in the connection's buffer."""

    def __init__(self, limit_s: float, hold_s: float) -> None:
        self.limit_s = limit_s
        self.hold_s = hold_s
        self._pending: set[str] = set()
        self._cond = threading.Condition()
        self.waits = self.timeouts = 0  # waits, and those that ended at limit_s

    def expect(self, stream_ids: list[str]) -> None:
        with self._cond:
            self._pending.update(stream_ids)

    def sent(self, stream_id: str) -> None:
        """A batch of ``stream_id`` went out live (the worker's event loop)."""
        if stream_id in self._pending:  # the common case, a later batch, takes no lock
            with self._cond:
                self._pending.discard(stream_id)
                if not self._pending:
                    self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self.waits += 1
            if not self._cond.wait_for(lambda: not self._pending, self.limit_s):
                self.timeouts += 1
            self._pending.clear()  # one not sent by now (refused, taken, its writer gone) is not waited for again
        # Sent is queued in the worker's connection: the cores a moment longer, for the flush, the
        # server and the relay to carry it to the client.
        time.sleep(self.hold_s)


@dataclass
class _State:
    job: Job
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopMatcher
    first: bool = True


def encode_prompt(tokenizer: Any, request: Request) -> list[int]:
    """Token ids for a request: chat template for ``messages``, plain encoding for ``prompt``."""
    if request.input_ids is not None:
        return list(request.input_ids)
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template; send 'prompt' instead", param="messages")
        enc = tokenizer.apply_chat_template([dict(m) for m in request.messages], add_generation_prompt=True,
                                            tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        return [int(t) for t in ids]
    assert request.prompt is not None
    return [int(t) for t in tokenizer.encode(request.prompt)]


def torch_thread() -> ThreadPoolExecutor:
    """The one thread a generator process does all its torch work on: loading, the KV cache, steps.

    OpenMP keeps a worker team per thread that enters a parallel region; once a second thread has
    done torch work the engine's steps ran 1.5x slower (measured at 32 streams), so the model is loaded on the
    same thread that later steps it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenpipe-engine")


@dataclass(frozen=True, slots=True)
class _Cancel:
    key: str  # the job's (Job.key)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A job with its prompt encoded, or the error its encoding raised (the engine thread reports it)."""

    job: Job
    prompt: list[int]
    error: Exception | None = None


class _Stop:
    """Ends the engine thread's loop."""


_STOP = _Stop()
_Inbox = _Prepared | _Cancel | _Stop  # what the worker hands the engine thread (through the tokenizer thread), in order


class Runner(EngineHandle):
    """Owns an :class:`Engine` on a dedicated thread."""

    def __init__(self, loaded: LoadedModel, on_emit: Callable[[list[Emission]], None], *,
                 on_step: Callable[[int], None] | None = None, torch_thread: Executor | None = None,
                 admission_hold_s: float = 0.01, owner_weights: Mapping[str, float] | None = None,
                 **engine_args: Unpack[EngineArgs]) -> None:
        self.loaded = loaded
        self.owner_weights = dict(owner_weights or {})  # fair-share weight per owner (tokenpipe.quota)
        self.admission_hold_s = admission_hold_s
        self.torch_thread = torch_thread
        make = partial(Engine, loaded, **engine_args)
        # The KV cache is allocated where the steps will run (see :func:`torch_thread`).
        self.engine = make() if torch_thread is None else torch_thread.submit(make).result()
        self.on_emit = on_emit
        self.on_step = on_step
        self._inbox: queue.SimpleQueue[_Inbox] = queue.SimpleQueue()
        # One thread, first in first out: jobs and cancellations reach the engine in the order handed over.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenpipe-tokenize")
        self._states: dict[str, _State] = {}
        self._handed = 0  # jobs submitted and not yet handled (the engine's room does not count them yet)
        self._handed_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running: Future[None] | None = None
        # Set by a worker that sends the live copies (None: nothing to wait for)
        self.first_batches: FirstBatchGate | None = None

    @classmethod
    def for_settings(cls, loaded: LoadedModel, settings: Settings, on_emit: Callable[[list[Emission]], None], *,
                     on_step: Callable[[int], None] | None = None, torch_thread: Executor | None = None) -> Runner:
        """A runner sized and tuned by ``settings`` (the generator's thread and its engine-core process)."""
        return cls(loaded, on_emit, on_step=on_step, max_batch=settings.max_batch, max_seq_len=settings.max_seq_len,
                   prefill_token_budget=settings.prefill_token_budget, prefill_step_s=settings.prefill_step_ms / 1000,
                   max_prompt_tokens=settings.max_prompt_tokens,
                   torch_thread=torch_thread, admission_hold_s=settings.admission_hold_ms / 1000,
                   kv_cache_mb=settings.kv_cache_mb, prefix_caching=settings.prefix_caching,
                   cuda_graphs=settings.cuda_graphs, owner_weights=parse_weights(settings.owner_weights),
                   owner_max_running=settings.owner_max_running)

    # -- thread-safe API -------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._handed_lock:
            self._handed += 1
        self._tokenizer_thread.submit(self._prepare, job)

    @property
    def memory_room(self) -> int:
        """More requests the KV cache can take now (see :meth:`Engine._room`), less those handed
        over and not yet queued in the engine."""
        return self.engine.room - self._handed

    def cancel(self, request_id: str) -> None:
        # Behind the jobs handed over before it: a cancel that overtook its job would be lost.
        self._tokenizer_thread.submit(self._inbox.put, _Cancel(request_id))

    def start(self) -> None:
        if self.torch_thread is not None:
            self._running = self.torch_thread.submit(self._loop)
            return
        self._thread = threading.Thread(target=self._loop, name="tokenpipe-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)  # jobs not yet encoded are dropped
        self._inbox.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._running is not None:
            try:
                self._running.result(timeout)
            except TimeoutError:
                log.warning("engine thread did not stop in time", extra={"timeout_s": timeout})

    @property
    def running(self) -> int:
        return len(self.engine.rows)

    def stats(self) -> EngineStats:
        """The engine's counters, read from another thread: each an int replaced whole."""
        engine, pool = self.engine, self.engine.pool
        return EngineStats(running=len(engine.rows), preemptions=engine.preemptions, block_size=BLOCK_SIZE,
                           blocks_used=pool.used, blocks_capacity=pool.capacity, blocks_cached=pool.cached,
                           prefix_query_tokens=pool.query_tokens, prefix_hit_tokens=pool.hit_tokens)

    # -- tokenizer thread ------------------------------------------------------------
    def _prepare(self, job: Job) -> None:
        """Encode ``job``'s prompt and hand it to the engine thread (the error too: reported there, in order)."""
        try:
            self._inbox.put(_Prepared(job, encode_prompt(self.loaded.tokenizer, job.request)))
        except Exception as exc:  # hostile input can fail the tokenizer: the job's error emission says so
            self._inbox.put(_Prepared(job, [], exc))

    # -- engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        hold_until = 0.0
        tuning, tuning_wait = self.loaded.tuning, 0.0  # the kernel table's measurement, run while idle
        stepped = False  # since the heap was last handed back
        while True:
            wait = hold_until - time.monotonic()
            item: _Inbox | None
            settling = False
            try:
                if wait > 0:
                    item = self._inbox.get(timeout=wait)
                elif tuning is not None and self.engine.idle:
                    item = self._inbox.get(timeout=tuning_wait) if tuning_wait > 0 else self._inbox.get_nowait()
                elif stepped and self.engine.idle:
                    settling = True
                    item = self._inbox.get(timeout=IDLE_TRIM_S)
                else:
                    item = self._inbox.get(block=self.engine.idle)
            except queue.Empty:
                item = None
                if settling:
                    # Idle a while after work: glibc keeps the heap a burst's prefills grew (its mmap threshold
                    # rises with what was freed), and an idle generator's RSS counted it (+226 MB after three
                    # ~1,000-token chats, fp32). Handed back once, off any request's path; the next burst
                    # faults in what it needs again. (A fixed low threshold kept RSS down while busy too, but
                    # its page faults cost 1k-token prefills 10-30 % of their time.)
                    release_freed_memory()
                    stepped = False
            while item is not None:
                if isinstance(item, _Stop):
                    if tuning is not None:
                        tuning.close()
                    return
                if isinstance(item, _Cancel):
                    self.engine.cancel(item.key)
                else:
                    self._admit(item)
                    with self._handed_lock:
                        self._handed -= 1
                    hold_until = self._hold(item.job, hold_until)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if hold_until:
                if hold_until > time.monotonic():
                    continue  # the rest of a burst is being handed over: prefill it together
                hold_until = 0.0  # waited long enough: the next burst gets its own hold
            if self.engine.idle:
                if tuning is not None:  # nothing to step: the next piece of the measurement (one unit at most)
                    tuning_wait = tuning.step() or 0.0
                    if tuning.done:
                        self.loaded.kernels, tuning = tuning.table, None
                continue
            stepped = True
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an engine fault must not take the worker down with it
                log.exception("engine step failed; failing the running batch")
                self._fail_all(f"engine failure: {exc}")
                continue
            if self.on_step is not None:
                self.on_step(self.engine.last_step_batch)
            emissions = [self._emission(o) for o in outputs]
            if emissions:
                gate, firsts = self.first_batches, [e.request_id for e in emissions if e.admitted_ns]
                if gate is not None and firsts:
                    gate.expect(firsts)
                self.on_emit(emissions)
                if gate is not None and firsts:
                    gate.wait()

    def _hold(self, job: Job, hold_until: float) -> float:
        """Until when to wait before the next step: an idle engine holds its first prefill while
        the worker hands over the rest of a burst it fetched (at most ``admission_hold_s``). A
        lone request is never held, and running rows never wait for newcomers."""
        if not job.more_coming:
            return 0.0
        if self.engine.rows or hold_until:
            return hold_until
        return time.monotonic() + self.admission_hold_s

    def _admit(self, prepared: _Prepared) -> None:
        job, key = prepared.job, prepared.job.key
        req = job.request
        carried = len(job.resume_ids)
        try:
            if prepared.error is not None:
                raise prepared.error
            original = prepared.prompt
            params = req.params
            # The key is the worker's stream key, ``<bus owner>.<id>`` (tokenpipe.subjects.stream_key).
            owner = fair_owner(key.partition(".")[0] if "." in key else "", req.tenant)
            seq = self.engine.new_sequence(key, original + list(job.resume_ids), params, carried=carried,
                                           batch=req.batch, owner=owner,
                                           weight=weight_of(self.owner_weights, owner))
            seq.max_new = min(seq.max_new, params.max_tokens - carried)
            if seq.max_new < 1:
                raise InvalidRequest("max_tokens already reached by resumed tokens")
        except TokenpipeError as exc:
            self.on_emit([Emission(key, (), "", time.time_ns(), finish="error", error=exc.message,
                                   usage=Usage(0, carried), error_code=exc.code)])
            return
        except Exception as exc:  # tokenizer failures on hostile input: report, keep serving
            log.exception("could not prepare request", extra={"request_id": req.id})
            self.on_emit([Emission(key, (), "", time.time_ns(), finish="error",
                                   error=f"could not prepare request: {exc}", usage=Usage(0, carried),
                                   error_code="invalid_request")])
            return
        # Rebuild the text state the previous worker had at the crash: text it still held back
        # (a partial UTF-8 character, a possible stop-string prefix) is released later, as it
        # would have been; what it had already published is not repeated.
        detok = IncrementalDetokenizer(self.loaded.tokenizer, original)
        stop = StopMatcher(params.stop)
        for token in job.resume_ids:
            _, matched = stop.feed(detok.push(token))
            if matched:  # the stop string completed exactly at the crash
                self.on_emit([Emission(key, (), "", time.time_ns(), finish="stop",
                                       usage=Usage(len(original), carried))])
                return
        self._states[key] = _State(job, seq, detok, stop)
        self.engine.add(seq)

    def _emission(self, out: StepOutput) -> Emission:
        seq = out.seq
        st = self._states[seq.id]
        finish: FinishReason | None = out.finish
        text, stopped = "", False
        if out.token is not None:
            text, stopped = st.stop.feed(st.detok.push(out.token))
            if stopped:
                finish = "stop"
                self.engine.finish(seq, "stop")
        if finish is not None and not stopped:
            # the end: release what the detokenizer and the stop matcher still hold
            tail, stopped = st.stop.feed(st.detok.flush())
            text += tail if stopped else tail + st.stop.flush()
        first = st.first
        st.first = False
        usage = None
        if finish is not None:
            del self._states[seq.id]
            resumed = len(st.job.resume_ids)
            usage = Usage(len(seq.prompt) - resumed, len(seq.generated) + resumed)
        return Emission(seq.id, (out.token,) if out.token is not None else (), text, time.time_ns(),
                        finish=finish, usage=usage, admitted_ns=seq.admitted_ns if first else 0)

    def _fail_all(self, message: str) -> None:
        emissions = []
        for seq in self.engine.abort_all():
            st = self._states.pop(seq.id, None)
            carried = len(st.job.resume_ids) if st else 0
            emissions.append(Emission(seq.id, (), "", time.time_ns(), finish="error", error=message,
                                      usage=Usage(len(seq.prompt) - carried, len(seq.generated) + carried),
                                      error_code="generation_error"))
        if emissions:
            self.on_emit(emissions)
