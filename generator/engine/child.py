"""The engine-core process, the engine's end: ``python -m generator.engine.child <fd>``.

It loads the model on its engine thread, reports it ready over the socket it was given, then runs
the :class:`~generator.engine.runner.Runner` on the jobs and cancels that arrive, sending one frame
per engine step back (:mod:`generator.engine.process` is the generator's end and the frames' format).
Only this process runs this module: it is not imported by the generator's.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from functools import partial
from multiprocessing.connection import Connection

import msgpack

from tokenpipe.logs import setup_logging
from tokenpipe.settings import Settings
from tokenpipe.wire import Request

from ..model.loader import load_for
from .handle import Emission, Job
from .process import CANCEL, FAILED, JOB, READY, STEP, STOP, counters_row, emission_row
from .runner import Runner, torch_thread

__all__: list[str] = []

log = logging.getLogger(__name__)


class _ChildLink:
    """The child's end: the runner's emissions go out one frame per step (on the engine thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.runner: Runner | None = None
        self.steps: list[int] = []
        self.accepted = 0

    def counters(self) -> list[int]:
        assert self.runner is not None
        return counters_row(self.runner.memory_room, self.accepted, self.runner.stats())

    def on_step(self, batch: int) -> None:
        self.steps.append(batch)

    def on_emit(self, emissions: list[Emission]) -> None:
        steps, self.steps = self.steps, []
        self.conn.send_bytes(msgpack.packb([STEP, [emission_row(e) for e in emissions], steps, self.counters()]))


def _child_main(conn: Connection) -> None:
    """The engine-core process: load the model on the engine thread, then serve the socket."""
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
        conn.send_bytes(msgpack.packb([FAILED, str(exc)]))
        os._exit(1)
    link.runner = runner
    conn.send_bytes(msgpack.packb([READY, {"name": loaded.name, "device": str(loaded.device),
                                            "dtype": str(loaded.dtype)}, link.counters()]))
    runner.start()
    while True:
        try:
            frame = msgpack.unpackb(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the generator is gone (killed): so is its engine, at once
        kind = frame[0]
        if kind == JOB:
            _, data, resume, more, key = frame
            runner.submit(Job(Request.decode(data), resume_ids=tuple(resume), more_coming=more, key=key))
            link.accepted += 1  # after submit: the generator's room estimate errs on the low side meanwhile
        elif kind == CANCEL:
            runner.cancel(frame[1])
        elif kind == STOP:
            break
    runner.stop()  # returns once the engine thread has sent its last frame
    os._exit(0)  # the engine thread's executor is not joined: the process is done


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])))
