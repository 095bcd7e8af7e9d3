"""The engine-core process: the :class:`~generator.runner.Runner` in a process of its own.

vLLM V1's EngineCore idea. The generator's asyncio loop (NATS, msgpack, the writers) and the
thread that steps the engine share one GIL when they share a process; on a GPU the launch of
a step's kernels then waits behind the loop's Python. Here the engine, its runner thread
(steps, sampling, detokenizing) and the model live in a spawned child, and the generator
talks to it over a Unix socket pair with length-prefixed msgpack frames
(:class:`multiprocessing.connection.Connection`); the child is ``python -m generator.engineproc``,
started fresh (never forked from a process whose torch threads run):

- generator → engine: a job (the request's wire bytes, resumed tokens), a cancel, stop;
- engine → generator: once per engine step, one frame with that step's emissions, the batch
  sizes of the steps since the last frame, and the counters the worker and its metrics read.

:class:`EngineProcess` offers what the worker uses of a :class:`Runner` (``submit``, ``cancel``,
``memory_room``, ``running``, ``engine`` counters, ``start``/``stop``), so the worker does not
know which it has. Failure semantics are the thread's: the engine process is the generator's
child and dies with it (it exits when its pipe closes); when it dies, ``on_exit`` tells the
generator, which hands its requests back to JetStream and exits for its supervisor to restart.
This frame format is process-local (both ends are the same code), not the NATS wire format.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from tokenpipe.errors import ConfigError, GenerationError
from tokenpipe.settings import Settings
from tokenpipe.wire import Request, Usage

from .runner import Emission, Job, Runner

__all__ = ["EngineCounters", "EngineProcess", "PoolCounters", "use_engine_process"]

log = logging.getLogger(__name__)

_JOB, _CANCEL, _STOP = 0, 1, 2  # generator -> engine
_READY, _STEP, _FAILED = 0, 1, 2  # engine -> generator
_START_TIMEOUT_S = 600.0  # loading (and converting) a model on a busy machine


def use_engine_process(mode: str, device: str) -> bool:
    """Whether ``TOKENPIPE_ENGINE_PROCESS`` puts the engine in its own process.

    ``auto`` is on with CUDA, where the engine thread's Python is what launches the kernels and
    the loop must not stall it, and off on CPU, where the A/B showed no consistent throughput win
    for the process (``python -m bench.enginecore``, bench/RESULTS.md)."""
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"TOKENPIPE_ENGINE_PROCESS={mode!r}: use one of auto, on, off", param="engine_process")
    if mode != "auto":
        return mode == "on"
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch  # only here: `auto` asks whether this machine has CUDA

    return bool(torch.cuda.is_available())


@dataclass
class PoolCounters:
    """The KV block pool's counters as last reported by the engine process (what
    :class:`~generator.kvcache.KVCacheMeter` and the announcements read)."""

    used: int = 0
    capacity: int = 0
    cached: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def available(self) -> int:
        return self.capacity - self.used


@dataclass
class EngineCounters:
    """The engine state the worker reads (``runner.engine`` of the thread version)."""

    pool: PoolCounters = field(default_factory=PoolCounters)
    preemptions: int = 0
    room: int = 0
    running: int = 0


def _emission_row(em: Emission) -> list[Any]:
    usage = None if em.usage is None else [em.usage.prompt_tokens, em.usage.completion_tokens]
    return [em.request_id, list(em.token_ids), em.text, em.at_ns, em.finish, em.error, usage, em.admitted_ns,
            em.error_code]


def _emission(row: list[Any]) -> Emission:
    rid, tokens, text, at_ns, finish, error, usage, admitted_ns, code = row
    return Emission(rid, tuple(tokens), text, at_ns, finish=finish, error=error,
                    usage=None if usage is None else Usage(*usage), admitted_ns=admitted_ns, error_code=code)


class EngineProcess:
    """A :class:`Runner` in a spawned child process, driven from the generator's process."""

    def __init__(self, settings: Settings, on_emit: Callable[[list[Emission]], None] | None = None, *,
                 on_step: Callable[[int], None] | None = None,
                 on_exit: Callable[[int | None], None] | None = None) -> None:
        self.settings = settings
        self.on_emit = on_emit
        self.on_step = on_step
        self.on_exit = on_exit
        self.engine = EngineCounters()
        self._accepted = 0  # jobs the child had taken when it last reported
        self._sent = 0
        self._send_lock = threading.Lock()
        self._stopping = False
        self.dead = False  # the child exited without being asked to
        self.process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None

    # -- lifecycle (blocking: call from a thread) ---------------------------------------
    def load(self) -> dict[str, Any]:
        """Start the child and wait until it has loaded the model; returns what it reported."""
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-m", "generator.engineproc", str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),))
        # the child holds the only other end now: EOF on ours means the child is gone
        self._conn = conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps(self.settings))
        if not conn.poll(_START_TIMEOUT_S):
            self.process.kill()
            raise GenerationError("the engine-core process did not load its model in time")
        try:
            frame = msgpack.unpackb(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise GenerationError(f"the engine-core process exited while loading (exit {self._exitcode()})") from exc
        if frame[0] == _FAILED:
            raise GenerationError(f"the engine-core process could not load the model: {frame[1]}")
        info: dict[str, Any] = frame[1]  # name, device, dtype
        self._counters(frame[2])
        log.info("engine-core process ready", extra={"pid": self.process.pid, "device": info.get("device")})
        return info

    def start(self) -> None:
        """Start draining the child's frames (``on_emit`` is called on the reader thread)."""
        if self._reader is not None:
            raise RuntimeError("the engine-core process is already being drained")
        self._reader = threading.Thread(target=self._read, name="tokenpipe-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.process is None or self._conn is None:
            return
        if not self.dead and self.process.poll() is None:
            self._send([_STOP])
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine-core process did not stop in time; killing it", extra={"timeout_s": timeout})
            self.process.kill()
            self.process.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    # -- the Runner API ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._sent += 1
        self._send([_JOB, job.request.encode(), list(job.resume_ids), job.more_coming])

    def cancel(self, request_id: str) -> None:
        if self.dead:
            return  # the engine and the request's state died together: nothing left to cancel
        self._send([_CANCEL, request_id])

    @property
    def memory_room(self) -> int:
        """As :attr:`Runner.memory_room`, less the jobs sent that the child had not taken yet."""
        return self.engine.room - (self._sent - self._accepted)

    @property
    def running(self) -> int:
        return self.engine.running

    # -- internals -----------------------------------------------------------------
    def _exitcode(self) -> int | None:
        assert self.process is not None
        try:
            return self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return None  # its socket closed but it has not exited yet

    def _send(self, frame: list[Any]) -> None:
        if self._conn is None:
            raise GenerationError("the engine-core process was not started")
        data = msgpack.packb(frame)
        try:
            with self._send_lock:  # the loop thread and the stopping thread may both send
                self._conn.send_bytes(data)
        except (OSError, ValueError) as exc:
            raise GenerationError(f"the engine-core process is gone (exit {self._exitcode()})") from exc

    def _counters(self, c: list[int]) -> None:
        e, p = self.engine, self.engine.pool  # in _ChildLink.counters' order
        e.room, self._accepted, e.running, e.preemptions, p.used, p.capacity, p.cached, p.query_tokens, p.hit_tokens = c

    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                frame = msgpack.unpackb(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            _, rows, steps, counters = frame  # after load() the child sends only _STEP frames
            self._counters(counters)
            if self.on_step is not None:
                for batch in steps:
                    self.on_step(batch)
            if rows and self.on_emit is not None:
                self.on_emit([_emission(r) for r in rows])
        if self._stopping:
            return
        self.dead = True
        code = self._exitcode()
        log.error("the engine-core process died; handing the requests back", extra={"exit": code})
        if self.on_exit is not None:
            self.on_exit(code)


# -- the child ---------------------------------------------------------------------
class _ChildLink:
    """The child's end: the runner's emissions go out one frame per step (on the engine thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.runner: Runner | None = None
        self.steps: list[int] = []
        self.accepted = 0

    def counters(self) -> list[int]:
        assert self.runner is not None
        engine = self.runner.engine
        pool = engine.pool
        return [self.runner.memory_room, self.accepted, len(engine.rows), engine.preemptions, pool.used,
                pool.capacity, pool.cached, pool.query_tokens, pool.hit_tokens]

    def on_step(self, batch: int) -> None:
        self.steps.append(batch)

    def on_emit(self, emissions: list[Emission]) -> None:
        steps, self.steps = self.steps, []
        self.conn.send_bytes(msgpack.packb([_STEP, [_emission_row(e) for e in emissions], steps, self.counters()]))


def _child_main(conn: Connection) -> None:
    """The engine-core process: load the model on the engine thread, then serve the socket."""
    from tokenpipe.logs import setup_logging

    from .main import load_for
    from .runner import torch_thread

    # The generator decides when its engine stops (a terminal's Ctrl-C reaches the whole process group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    settings: Settings = pickle.loads(conn.recv_bytes())
    setup_logging("engine-core", settings.log_level, settings.log_json)
    link = _ChildLink(conn)
    engine_thread = torch_thread()
    try:
        loaded = engine_thread.submit(partial(load_for, settings)).result()
        runner = Runner.for_settings(loaded, settings, link.on_emit, on_step=link.on_step,
                                     torch_thread=engine_thread)
    except Exception as exc:  # reported to the generator, which exits with it
        log.exception("engine-core process could not load the model")
        conn.send_bytes(msgpack.packb([_FAILED, str(exc)]))
        os._exit(1)
    link.runner = runner
    conn.send_bytes(msgpack.packb([_READY, {"name": loaded.name, "device": str(loaded.device),
                                            "dtype": str(loaded.dtype)}, link.counters()]))
    runner.start()
    while True:
        try:
            frame = msgpack.unpackb(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the generator is gone (killed): so is its engine, at once
        kind = frame[0]
        if kind == _JOB:
            _, data, resume, more = frame
            runner.submit(Job(Request.decode(data), resume_ids=tuple(resume), more_coming=more))
            link.accepted += 1  # after submit: the generator's room estimate errs on the low side meanwhile
        elif kind == _CANCEL:
            runner.cancel(frame[1])
        elif kind == _STOP:
            break
    runner.stop()  # returns once the engine thread has sent its last frame
    os._exit(0)  # the engine thread's executor is not joined: the process is done


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])))
