"""The Batch API's runner, one per relay: it runs each batch's lines as ordinary requests at the
batch class (``service_tier: flex``, so the generators serve interactive work first), on the same
queue and path as ``POST /v1/streams``, and writes the output and error files.

Each line is the stream ``<batch id>-<line index>``. A batch is held by one runner at a time
under a lease in its record (:mod:`relay.batchdb`, compare-and-set), renewed every second with
its ``request_counts``; a runner that stops hands its batches back, one that dies lets its lease
lapse (``LEASE_S``). Whichever runner then takes the batch over runs it again from its first
line: a line whose stream exists already is not submitted again, only read back from the token
store (a finished one at once), so nothing is generated twice and nothing is lost. The output is
only written once every line is done; until then it lives in the streams themselves.

A line whose stream ended in a server-side failure (``generation_error``: every delivery of it died
with its generator) runs again as ``<batch id>-<line index>-r<n>``, up to ``LINE_ATTEMPTS`` runs in
all: a fault in the fleet is not the line's doing. A takeover follows the same chain of ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from tokenpipe.background import stop_loops
from tokenpipe.bus import Bus
from tokenpipe.errors import (
    GenerationError,
    ModelNotFound,
    NoGenerator,
    NotFound,
    Overloaded,
    StreamExpired,
    StreamNotFound,
    TokenpipeError,
    TransportError,
)
from tokenpipe.settings import Settings
from tokenpipe.streams import cancel, get_meta
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire import StreamMeta, TokenBatch

from .batchdb import BatchDB, BatchRecord, Conflict
from .batchlines import LineRejected, Row, check_line, error_row, expired_row, output_row
from .batchproto import OPEN_STATUSES, BatchError, BatchErrors, RequestCounts
from .openai import completion_reply
from .protocol import Bodies
from .registry import GeneratorRegistry
from .sessions import Forwarder, Session

__all__ = ["BatchRunner", "LEASE_S", "LINE_ATTEMPTS"]

log = logging.getLogger(__name__)

LEASE_S = 15.0  # a runner that stops renewing its batch (it died) loses it after this long
_HEARTBEAT_S = 1.0  # lease renewal and request_counts, written this often
_RETRY_S = 2.0  # a line whose model has no generator yet, or whose queue is full, tries again after this
LINE_ATTEMPTS = 3  # runs of a line whose stream ended in a server-side failure


class _LeaseLost(Exception):
    """Another runner holds the batch now: this one stops, leaving the streams to it."""


@dataclasses.dataclass
class _Job:
    record: BatchRecord
    completed: int = 0
    failed: int = 0
    total: int = 0
    cancelled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    halt: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # cancelled, or a line interrupted
    interrupted: list[TokenpipeError] = dataclasses.field(default_factory=list)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    expired: bool = False  # its completion window passed: the lines not done end as batch_expired
    floor: RequestCounts = dataclasses.field(default_factory=RequestCounts)  # the counts its last runner wrote

    def cancel(self) -> None:
        self.cancelled.set()
        self.halt.set()

    def expire(self) -> None:
        self.expired = True
        self.halt.set()

    def counts(self) -> RequestCounts:
        """What the record shows. A runner taking the batch over reads its finished lines back from
        the store, so its own counts start at 0 and catch up: until then the last runner's stand, and
        the counts never move backwards."""
        f = self.floor
        return RequestCounts(total=max(self.total, f.total), completed=max(self.completed, f.completed),
                             failed=max(self.failed, f.failed))


class BatchRunner:
    def __init__(self, settings: Settings, db: BatchDB, bus: Callable[[], Bus], registry: GeneratorRegistry,
                 forwarder: Forwarder, bodies: Bodies) -> None:
        self.settings = settings
        self.db = db
        self._bus = bus
        self.registry = registry
        self.forwarder = forwarder
        self.bodies = bodies
        self.id = secrets.token_hex(8)  # this process's runner, in the leases it holds
        self._slots = asyncio.Semaphore(max(1, settings.batch_concurrency))
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled), not at the next round."""
        self._wake.set()

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._scan_loop(), name="batch-runner")

    async def stop(self) -> None:
        """Hand every batch back (its lease released: another relay, or this one restarted, goes on at once)."""
        if self._loop is not None:
            await stop_loops(self._stopping, [self._loop])
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _scan_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._scan_once()
            except TokenpipeError as exc:  # storage not provisioned yet, NATS away: the next round tries again
                log.warning("batch scan failed", extra={"error": exc.message})
            # Until woken (a batch created or cancelled here), or the next round: a lease elsewhere may lapse.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), LEASE_S / 3)
            self._wake.clear()

    async def _scan_once(self) -> None:
        """Take every open batch that no live runner holds."""
        now = time.time()
        for record in await self.db.batches():
            b = record.batch
            if b.status not in OPEN_STATUSES or b.id in self._running:
                continue
            if record.runner and record.runner != self.id and record.lease_until > now:
                continue
            record.runner, record.lease_until = self.id, now + LEASE_S
            try:
                record = await self.db.update(record)
            except Conflict:
                continue  # another runner took it, or it changed: the next round looks again
            log.info("batch taken", extra={"batch_id": b.id, "status": b.status, "tenant": record.tenant})
            task = asyncio.create_task(self._run(_Job(record)), name=f"batch-{b.id}")
            self._running[b.id] = task
            task.add_done_callback(functools.partial(self._done, b.id))

    def _done(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(batch_id, None)

    # -- one batch --------------------------------------------------------------------------------

    async def _save(self, job: _Job, change: Callable[[BatchRecord], None]) -> None:
        """Apply ``change`` to the batch's record and write it (compare-and-set, with the counts and a
        renewed lease); on a conflict read it again: a cancel is taken in, a lost lease raises."""
        async with job.lock:
            record = job.record
            for _ in range(5):
                change(record)
                record.batch.request_counts = job.counts()
                if job.cancelled.is_set() and record.batch.status in ("validating", "in_progress", "finalizing"):
                    record.batch.status = "cancelling"
                if record.runner == self.id:
                    record.lease_until = time.time() + LEASE_S
                try:
                    job.record = await self.db.update(record)
                    return
                except Conflict:
                    fresh = await self.db.batch(record.tenant, record.batch.id)
                    if fresh.runner != self.id:
                        raise _LeaseLost from None
                    if fresh.batch.status == "cancelling":
                        job.cancel()
                        record.batch.cancelling_at = fresh.batch.cancelling_at
                    record.revision = fresh.revision
            raise _LeaseLost

    async def _heartbeat(self, job: _Job) -> None:
        while True:
            await asyncio.sleep(_HEARTBEAT_S)  # a period, not synchronisation
            await self._save(job, lambda r: None)

    async def _run(self, job: _Job) -> None:
        b = job.record.batch
        job.floor = b.request_counts
        if b.status == "cancelling":
            job.cancel()
        heart = asyncio.create_task(self._heartbeat(job), name=f"batch-heartbeat-{b.id}")
        finished = False
        try:
            await self._execute(job, heart)
            finished = True
        except _LeaseLost:
            log.warning("batch lease lost to another runner", extra={"batch_id": b.id})
            finished = True
        except TokenpipeError as exc:
            log.warning("batch interrupted; it resumes", extra={"batch_id": b.id, "error": exc.message})
        except Exception:  # a bug: logged, and the batch handed back rather than left held
            log.exception("batch runner failed", extra={"batch_id": b.id})
        finally:
            heart.cancel()
            with contextlib.suppress(asyncio.CancelledError, _LeaseLost, TokenpipeError):
                await heart
            if not finished:  # stopping (or a failure): hand it back for whoever runs next
                job.record.runner, job.record.lease_until = "", 0.0
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.db.update(job.record))

    async def _execute(self, job: _Job, heart: asyncio.Task[None]) -> None:
        b = job.record.batch
        try:
            data = await self.db.content(job.record.tenant, b.input_file_id)
            lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
        except NotFound as exc:
            return await self._fail(job, "input_file_gone", exc.message)
        if not lines:
            return await self._fail(job, "empty_file", "the input file holds no requests")
        job.total = len(lines)

        def started(r: BatchRecord) -> None:
            if r.batch.status == "validating":
                r.batch.status, r.batch.in_progress_at = "in_progress", int(time.time())

        await self._save(job, started)
        results: list[Row | None] = [None] * len(lines)
        seen: set[str] = set()
        pending: set[asyncio.Task[None]] = set()

        async def one(index: int, line: str) -> None:
            try:
                result = await self._line(job, index, line, seen)
            except TokenpipeError as exc:  # not the line's fault (NATS away): the batch stops, to resume later
                job.interrupted.append(exc)
                job.halt.set()
                return
            results[index] = result
            if result[0] == "out":
                job.completed += 1
            else:
                job.failed += 1

        def ended(task: asyncio.Task[None]) -> None:
            pending.discard(task)
            self._slots.release()

        halt_wait = asyncio.ensure_future(job.halt.wait())
        # The completion window: a timer, so a batch taken over after it passed expires at once.
        window = (b.expires_at - time.time()) if b.expires_at is not None else None
        expiry = asyncio.get_running_loop().call_later(max(0.0, window), job.expire) if window is not None else None
        try:
            for index, line in enumerate(lines):
                acquire = asyncio.ensure_future(self._slots.acquire())
                await asyncio.wait({acquire, halt_wait, heart}, return_when=asyncio.FIRST_COMPLETED)
                if not acquire.done():
                    acquire.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await acquire
                    if acquire.done() and not acquire.cancelled():
                        self._slots.release()
                    break
                if heart.done() or job.halt.is_set():
                    self._slots.release()
                    break
                task = asyncio.create_task(one(index, line))
                pending.add(task)
                # Released by the task's end however it ends (a task cancelled before it ever ran
                # runs no finally of its own).
                task.add_done_callback(ended)
            while pending and not job.halt.is_set() and not heart.done():
                await asyncio.wait({*pending, halt_wait, heart}, return_when=asyncio.FIRST_COMPLETED)
            if heart.done():
                heart.result()  # the lease was lost (raises)
        finally:
            if expiry is not None:
                expiry.cancel()
            halt_wait.cancel()
            for task in list(pending):
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if job.interrupted and not (job.cancelled.is_set() or job.expired):
            raise job.interrupted[0]
        if job.expired and not job.cancelled.is_set():
            for index, line in enumerate(lines):
                if results[index] is None:
                    results[index] = expired_row(f"{b.id}-{index}", _custom_id(line))
                    job.failed += 1
        await self._finalize(job, results)

    async def _fail(self, job: _Job, code: str, message: str) -> None:
        def failed(r: BatchRecord) -> None:
            r.batch.status, r.batch.failed_at = "failed", int(time.time())
            r.batch.errors = BatchErrors(data=[BatchError(code=code, message=message, param="input_file_id")])
            r.runner, r.lease_until = "", 0.0
        await self._save(job, failed)

    async def _finalize(self, job: _Job, results: list[Row | None]) -> None:
        b = job.record.batch
        await self._save(job, lambda r: setattr(r.batch, "finalizing_at", int(time.time())))
        if not job.cancelled.is_set():
            await self._save(job, lambda r: setattr(r.batch, "status", "finalizing"))
        ids: dict[str, str | None] = {}
        for kind in ("out", "err"):
            rows = [line for r in results if r is not None and r[0] == kind for line in (r[1],)]
            if rows:
                data = "".join(_json_line(row) for row in rows).encode()
                name = f"{b.id}_{'output' if kind == 'out' else 'error'}.jsonl"
                stored = await self.db.put_file(job.record.tenant, name, "batch_output", data,
                                                self.settings.batch_retention_s)
                ids[kind] = stored.id
        cancelled = job.cancelled.is_set() and any(r is None for r in results)
        expired = job.expired and not cancelled

        def done(r: BatchRecord) -> None:
            now = int(time.time())
            r.batch.output_file_id, r.batch.error_file_id = ids.get("out"), ids.get("err")
            if cancelled:
                r.batch.status, r.batch.cancelled_at = "cancelled", now
            elif expired:
                r.batch.status, r.batch.expired_at = "expired", now
            else:
                r.batch.status, r.batch.completed_at = "completed", now
            r.runner, r.lease_until = "", 0.0

        job.cancelled.clear()  # the final status stands as decided above
        await self._save(job, done)
        log.info("batch finished", extra={"batch_id": b.id, "status": job.record.batch.status,
                                          "completed": job.completed, "failed": job.failed})

    # -- one line ---------------------------------------------------------------------------------

    async def _line(self, job: _Job, index: int, line: str, seen: set[str]) -> Row:
        """The output or error line of line ``index`` of the input file."""
        b = job.record.batch
        stream_id = f"{b.id}-{index}"
        number = index + 1  # as an editor counts (blank lines aside)
        try:
            custom_id, parsed = check_line(line, stream_id=stream_id, number=number, endpoint=b.endpoint,
                                           bodies=self.bodies, seen=seen)
        except LineRejected as rejected:
            return rejected.row
        while True:
            try:
                model = await self.registry.resolve(parsed.model)
                break
            except ModelNotFound as exc:
                return error_row(stream_id, custom_id, 404, exc.code, f"request {number}: {exc.message}", "model")
            except NoGenerator:
                await asyncio.sleep(_RETRY_S)  # the batch waits for a generator, as a queued request would
        request = parsed.to_request(model, job.record.tenant)
        for attempt in range(LINE_ATTEMPTS):
            req = dataclasses.replace(request, id=stream_id if attempt == 0 else f"{stream_id}-r{attempt}")
            try:
                final, text = await self._generate(req)
            except asyncio.CancelledError:
                if job.cancelled.is_set() or job.expired:  # not the relay stopping: stop its generation
                    with contextlib.suppress(Exception):
                        await asyncio.shield(cancel(self._bus(), req.id))
                raise
            if final.finish != "error" or final.error_code != GenerationError.code:
                break
            log.warning("batch line failed on the server; running it again",
                        extra={"batch_id": b.id, "request_id": req.id, "error": final.error, "attempt": attempt + 1})
        status, reply = completion_reply(req, final, text, b.created_at, b.endpoint == "/v1/chat/completions")
        return output_row(req.id, custom_id, status, reply)

    async def _generate(self, req: TpRequest) -> tuple[TokenBatch, str]:
        """The line's stream, whole: submitted unless it exists already (a batch resumed), then read
        from its start. One recorded whose request or history is gone is submitted again."""
        meta: StreamMeta | None
        try:
            meta = await get_meta(self._bus(), req.id)
        except StreamNotFound:
            meta = None
        while True:
            live = None
            if meta is None:
                live = await self._submit(req)
            session = Session(req.id, req.tenant, cancel_on_exit=False, reader=False, live=live, meta=meta)
            text: list[str] = []
            try:
                async for item in self.forwarder.batches(session, idle=self.settings.keepalive_s):
                    if isinstance(item, TokenBatch):
                        text.append(item.text)
                        if item.is_final:
                            return item, "".join(text)
            except StreamExpired:
                if meta is None:
                    raise
                meta = None  # recorded, but neither queued, running nor stored: run it again
            finally:
                session.close()
            if meta is not None:
                raise TransportError(f"stream {req.id} ended without a final batch")

    async def _submit(self, req: TpRequest) -> Any:
        while True:
            try:
                return await self.forwarder.submit(req, follow=True)
            except Overloaded as exc:  # the queue is full: a batch waits its turn
                await asyncio.sleep(max(_RETRY_S, float(exc.retry_after)))


def _custom_id(line: str) -> str | None:
    """A line's ``custom_id`` where it has one (an expired line that never ran was never checked)."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    given = raw.get("custom_id") if isinstance(raw, dict) else None
    return given if isinstance(given, str) else None


def _json_line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"
