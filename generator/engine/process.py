"""The engine-core process, the generator's end: the :class:`~generator.engine.runner.Runner` in a process of
its own.

vLLM V1's EngineCore idea. The generator's asyncio loop (NATS, msgpack, the writers) and the
thread that steps the engine share one GIL when they share a process; on a GPU the launch of
a step's kernels then waits behind the loop's Python. Here the engine, its runner thread
(steps, sampling, detokenizing) and the model live in a spawned child, and the generator
talks to it over a Unix socket pair with length-prefixed msgpack frames
(:class:`multiprocessing.connection.Connection`); the child is ``python -m generator.engine.child``
(:mod:`generator.engine.child`), started fresh (never forked from a process whose torch threads run):

- generator → engine: a job (the request's wire bytes, resumed tokens), a cancel, stop;
- engine → generator: once per engine step, one frame with that step's emissions, the batch
  sizes of the steps since the last frame, and the counters the worker and its metrics read.

:class:`EngineProcess` implements :class:`~generator.engine.handle.EngineHandle`, as the
:class:`~generator.engine.runner.Runner` does, so the worker does not know which it has. Failure
semantics are the thread's: the engine process is the generator's child and dies with it (it exits
when its pipe closes); when it dies, ``on_exit`` tells the generator, which hands its requests back
to JetStream and exits for its supervisor to restart.
This frame format is process-local (both ends are the same code), not the NATS wire format.
"""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from tokenpipe.errors import ConfigError, GenerationError
from tokenpipe.settings import Settings
from tokenpipe.wire import Usage

from .handle import Emission, EngineHandle, EngineStats, Job

__all__ = ["CANCEL", "FAILED", "JOB", "READY", "STEP", "STOP", "EngineProcess", "counters_row", "emission",
           "emission_row", "use_engine_process"]

log = logging.getLogger(__name__)

JOB, CANCEL, STOP = 0, 1, 2  # generator -> engine
READY, STEP, FAILED = 0, 1, 2  # engine -> generator
_START_TIMEOUT_S = 600.0  # loading (and converting) a model on a busy machine


def use_engine_process(mode: str, device: str) -> bool:
    """Whether ``TOKENPIPE_ENGINE_PROCESS`` puts the engine in its own process.

    ``auto`` is on with CUDA, where the engine thread's Python is what launches the kernels and
    the loop must not stall it, and off on CPU, where an A/B of the two showed no consistent throughput
    win for the process (``python -m bench.enginecore``)."""
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


def counters_row(room: int, accepted: int, stats: EngineStats) -> list[int]:
    """The engine's counters as a frame carries them: its room, the jobs it has taken, then its stats."""
    return [room, accepted, stats.running, stats.preemptions, stats.block_size, stats.blocks_used,
            stats.blocks_capacity, stats.blocks_cached, stats.prefix_query_tokens, stats.prefix_hit_tokens]


def emission_row(em: Emission) -> list[Any]:
    usage = None if em.usage is None else [em.usage.prompt_tokens, em.usage.completion_tokens]
    return [em.request_id, list(em.token_ids), em.text, em.at_ns, em.finish, em.error, usage, em.admitted_ns,
            em.error_code]


def emission(row: list[Any]) -> Emission:
    rid, tokens, text, at_ns, finish, error, usage, admitted_ns, code = row
    return Emission(rid, tuple(tokens), text, at_ns, finish=finish, error=error,
                    usage=None if usage is None else Usage(*usage), admitted_ns=admitted_ns, error_code=code)


class EngineProcess(EngineHandle):
    """A :class:`~generator.engine.runner.Runner` in a spawned child process, driven from the generator's process."""

    def __init__(self, settings: Settings, on_emit: Callable[[list[Emission]], None] | None = None, *,
                 on_step: Callable[[int], None] | None = None,
                 on_exit: Callable[[int | None], None] | None = None) -> None:
        self.settings = settings
        self.on_emit = on_emit
        self.on_step = on_step
        self.on_exit = on_exit
        self._stats = EngineStats()  # as the child last reported them, replaced whole
        self._room = 0
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
            self.process = subprocess.Popen([sys.executable, "-m", "generator.engine.child", str(theirs.fileno())],
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
        if frame[0] == FAILED:
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
            self._send([STOP])
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine-core process did not stop in time; killing it", extra={"timeout_s": timeout})
            self.process.kill()
            self.process.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    # -- the EngineHandle ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._sent += 1
        self._send([JOB, job.request.encode(), list(job.resume_ids), job.more_coming, job.key])

    def cancel(self, request_id: str) -> None:
        if self.dead:
            return  # the engine and the request's state died together: nothing left to cancel
        self._send([CANCEL, request_id])

    @property
    def memory_room(self) -> int:
        """As the Runner's ``memory_room``, less the jobs sent that the child had not taken yet."""
        return self._room - (self._sent - self._accepted)

    @property
    def running(self) -> int:
        return self._stats.running

    def stats(self) -> EngineStats:
        return self._stats

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
        self._room, self._accepted = c[0], c[1]  # in counters_row's order
        self._stats = EngineStats(*c[2:])

    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                frame = msgpack.unpackb(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            _, rows, steps, counters = frame  # after load() the child sends only STEP frames
            self._counters(counters)
            if self.on_step is not None:
                for batch in steps:
                    self.on_step(batch)
            if rows and self.on_emit is not None:
                self.on_emit([emission(r) for r in rows])
        if self._stopping:
            return
        self.dead = True
        code = self._exitcode()
        log.error("the engine-core process died; handing the requests back", extra={"exit": code})
        if self.on_exit is not None:
            self.on_exit(code)
