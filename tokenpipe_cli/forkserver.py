"""Generators forked from one process that imported torch once: ``tokenpipe up``'s fork server.

A generator is a Python process that imports torch, numpy, gguf, tokenizers and tokenpipe's engine
before it loads its model: about 1.4 s of CPU each on the 2-core machines measured, paid once per
generator and again at every restart, while the other generators and the relay start on the same
cores. ``tokenpipe up`` instead starts one fork server first thing (it imports all that while
nats-server starts and the streams are set up) and forks each generator from it, restarts included:
multiprocessing's ``forkserver`` start method, and how PyTorch's DataLoader workers start. The fork
comes before anything a fork would break is started: the server never touches a tensor, an OpenMP
pool, CUDA or a thread of its own, so each generator sets up its own after the fork.

The supervisor talks to it over two pipes (one JSON line per fork request on its stdin; ``pid``,
``exit`` and ``failed`` lines back on a descriptor of its own), and each forked generator is its
child: the server reaps it and reports its exit status as ``subprocess.Popen`` would
(:class:`ForkedProc`). Its output goes where ``up``'s goes. The server leaves once its stdin closes
and its last child exited; if the supervisor dies, the server gets SIGTERM and so, in turn, do the
generators (``launch.die_with_parent``), as spawned ones do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from .orphans import die_with_parent

if TYPE_CHECKING:  # the supervisor's side imports it when it forks: `tokenpipe up` starts this module first
    from .launch import Child

__all__ = ["PRELOAD", "ForkServer", "ForkedProc"]

log = logging.getLogger(__name__)

# What a generator imports before it loads a model (generator.main and what loading a GGUF brings).
PRELOAD = ("torch", "numpy", "gguf", "tokenizers", "yaml", "jinja2", "generator.main", "tokenpipe_cli.cli")
_START_TIMEOUT_S = 120.0


class ForkedProc:
    """A generator forked by the :class:`ForkServer`, with the part of ``subprocess.Popen`` that
    :class:`~tokenpipe_cli.launch.Child` uses. Its pid arrives a moment after the request."""

    def __init__(self, server: ForkServer) -> None:
        self._server = server
        self._pid: int | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """The generator's pid (waits for the server's answer)."""
        with self._server.changed:
            self._server.changed.wait_for(lambda: self._pid is not None or self.returncode is not None,
                                          _START_TIMEOUT_S)
        return self._pid if self._pid is not None else -1

    def known_pid(self) -> int | None:
        """Its pid if the server has answered yet (never waits)."""
        return self._pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"generator {self._pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pid = self.pid
        if pid > 0 and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited: the server reports it
                os.kill(pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The supervisor's end: starts the server process, asks it for forks, and tracks their exits."""

    def __init__(self, env: Mapping[str, str] | None = None, preload: Sequence[str] = PRELOAD) -> None:
        replies_r, replies_w = os.pipe()
        # Its own session, like every role (a terminal's Ctrl-C reaches only `up`); its output is up's.
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenpipe_cli.forkserver", str(replies_w), *preload],
                                     stdin=subprocess.PIPE, pass_fds=(replies_w,), env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        os.close(replies_w)
        self.changed = threading.Condition()
        self._pending: list[ForkedProc] = []  # asked for, pid not answered yet (answers come in order)
        self._procs: dict[int, ForkedProc] = {}
        self._gone = False
        self._ready = False
        self.broken = False  # it exited before it was ready (an import failed): fork nothing more from one
        self._discarded = False  # stopped by discard(): its exit before it was ready is no failure
        self._reader = threading.Thread(target=self._read, args=(os.fdopen(replies_r, "rb"),),
                                        name="forkserver-replies", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              new_session: bool = False) -> Child:
        """Fork ``tokenpipe <argv>`` (``env``: its whole environment; default ours). Returns at once; a server
        that is gone gives a child that has exited (SIGTERM, as its forks got)."""
        from .launch import Child

        proc = ForkedProc(self)
        line = json.dumps({"argv": list(argv), "env": dict(env if env is not None else os.environ),
                           "new_session": new_session}) + "\n"
        with self.changed:
            if self._gone:  # counts as exited at once: the supervisor's restart starts another server
                proc.returncode = -signal.SIGTERM
                return Child(name, proc)
            self._pending.append(proc)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError:  # it died just now: the reply reader marks what was pending as exited
            log.warning("the fork server exited while asked for a fork", extra={"role": name})
        return Child(name, proc)

    def discard(self) -> None:
        """Stop a server that forked nothing, at once (it reads no command until its imports are done)."""
        with self.changed:
            self._discarded = True
        self.proc.terminate()
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """No more forks: the server leaves once its generators exited (stop those first)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # the server is gone already
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the fork server did not exit; killing it", extra={"pid": self.proc.pid})
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout)

    def _read(self, replies: Any) -> None:
        for raw in replies:
            what, *rest = raw.decode().split()
            with self.changed:
                if what == "ready":
                    self._ready = True
                elif what == "pid":
                    proc = self._pending.pop(0)
                    proc._pid = int(rest[0])
                    self._procs[proc._pid] = proc
                elif what == "failed":  # the fork itself failed (out of memory, pids)
                    self._pending.pop(0).returncode = 1
                elif what == "exit":
                    done = self._procs.pop(int(rest[0]), None)
                    if done is not None:
                        done.returncode = int(rest[1])
                self.changed.notify_all()
        with self.changed:
            # The server is gone: its generators got SIGTERM from it (PR_SET_PDEATHSIG) and were re-parented,
            # so their exit status is lost. They count as exited (a restart forks from a new server).
            self._gone = True
            if not self._ready and not self._discarded:
                self.broken = True
                log.error("the fork server exited before it was ready (its output above says why): generators are "
                          "started as processes of their own", extra={"exit": self.proc.poll()})
            for proc in [*self._pending, *self._procs.values()]:
                proc.returncode = -signal.SIGTERM
            self._pending.clear()
            self._procs.clear()
            self.changed.notify_all()
        replies.close()


# -- the server process ---------------------------------------------------------------------------

def _serve(replies_fd: int, preload: Sequence[str]) -> int:
    import importlib

    for module in preload:
        importlib.import_module(module)
    os.write(replies_fd, b"ready\n")
    commands_fd = sys.stdin.fileno()
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup descriptor says a child exited
    children: set[int] = set()
    buffer = b""
    open_ = True
    while open_ or children:
        try:
            readable, _, _ = select.select([commands_fd, wake_r] if open_ else [wake_r], [], [])
        except InterruptedError:
            readable = []
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            os.write(replies_fd, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if commands_fd in readable:
            chunk = os.read(commands_fd, 65536)
            if not chunk:
                open_ = False  # the supervisor is done: leave once the generators have
                continue
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    print(f"tokenpipe: the fork server could not fork: {exc}", file=sys.stderr, flush=True)
                    os.write(replies_fd, b"failed\n")
                    continue
                if pid == 0:
                    _child(request, (commands_fd, replies_fd, wake_r, wake_w))
                children.add(pid)
                os.write(replies_fd, f"pid {pid}\n".encode())
    return 0


def _child(request: dict[str, Any], fds: tuple[int, ...]) -> NoReturn:
    """In the forked generator: undo what is the server's, become ``tokenpipe <argv>``, exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        server = os.getppid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # over the server's command pipe (its stdin)
        for fd in {null, *fds} - {0, 1, 2}:
            os.close(fd)
        if request.get("new_session"):
            os.setsid()
        die_with_parent()
        if os.getppid() != server:  # the server died before the line above took effect
            os._exit(1)
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        import torch

        torch.seed()  # each generator its own random state (the server's was copied into every fork)
        # What a spawned role runs (`python -m tokenpipe_cli ARGV`), run here: its __main__ exits with main()'s status.
        sys.argv = ["tokenpipe", *request["argv"]]
        runpy.run_module("tokenpipe_cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the generator's crash, reported as a spawned process's would be
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), sys.argv[2:]))
