"""The one way tokenpipe starts, waits for and stops a child process (a role, or nats-server).

``tokenpipe up``, the benchmarks and the tests all go through here:

    relay = spawn_role("relay", "--nats-url", url, "--port", str(port), log=tmp / "relay.log")
    wait_ready(http_ok(f"http://127.0.0.1:{port}/readyz"), timeout=60, what="the relay", children=[relay])
    ...
    stop_all([relay])
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tokenpipe.errors import TokenpipeError

from .orphans import die_with_parent

__all__ = ["Child", "LaunchError", "die_with_parent", "free_port", "free_ports", "http_ok", "port_free", "spawn",
           "spawn_role", "stop_all", "tcp_listening", "wait_ready"]

log = logging.getLogger(__name__)


class LaunchError(TokenpipeError):
    """A child process exited before it was ready, or did not become ready in time."""

    code = "launch_failed"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, chosen outside the kernel's ephemeral range.

    Not ``bind(host, 0)``: that hands out an ephemeral port, and until the server we start binds
    it, any outgoing connection on the machine may be given the same port as its local end (a
    cluster node failed to start with "bind: address already in use" in CI that way)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports as :func:`free_port` chooses them (a cluster's client, route and
    monitoring ports: separate calls could return one port twice)."""
    low, high = _ephemeral_range()
    spans = [(a, b) for a, b in ((10000, low - 1), (high + 1, 65535)) if b - a >= 1000]
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(100 * n if spans else 0):
        a, b = rng.choices(spans, weights=[b - a for a, b in spans])[0]
        port = rng.randint(a, b)
        if port not in chosen and port_free(port, host, reuse_addr=False):
            chosen.append(port)
            if len(chosen) == n:
                return chosen
    while len(chosen) < n:  # nothing outside the range (or no luck): what the kernel gives
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in chosen:
            chosen.append(port)
    return chosen


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_free(port: int, host: str = "127.0.0.1", reuse_addr: bool = True) -> bool:
    """Whether a server could listen on ``port`` now. With ``SO_REUSEADDR``, as uvicorn and
    nats-server bind: connections of a stack stopped a moment ago, in TIME_WAIT, do not count.
    Without it (:func:`free_ports`), such a port is passed over, as ``bind(host, 0)`` passes it."""
    with socket.socket() as sock:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Proc(Protocol):
    """What :class:`Child` needs of its process: ``subprocess.Popen``'s, or a forked generator's
    (:class:`tokenpipe_cli.forkserver.ForkedProc`)."""

    returncode: int | None

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Child:
    """A process started by :func:`spawn` (or forked by ``up``'s fork server)."""

    name: str
    proc: Proc
    log: Path | None = None  # where its output goes (None: inherited from us)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pid_now(self) -> int | None:
        """Its pid, or None while a fork server has not answered yet (never waits)."""
        known = getattr(self.proc, "known_pid", None)
        return known() if known is not None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: roles drain, then exit); does not wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for it to exit, then SIGKILL it; its exit status."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("child did not stop in time; killing it", extra={"child": self.name, "pid": self.pid})
            self.proc.kill()
            return self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s."""
        self.terminate()
        return self.wait_or_kill(timeout)

    def kill(self) -> int:
        """SIGKILL now (a test's tear-down, or a crash on purpose)."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


def spawn(name: str, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, log: Path | None = None,
          new_session: bool = False) -> Child:
    """Start ``cmd``. ``log`` (appended to: an earlier run's lines help when debugging a restart)
    takes its stdout and stderr; ``new_session`` keeps a terminal's Ctrl-C from reaching it, for a
    parent that stops its children itself, in order."""
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    # The child holds its own descriptor of the log.
    with open(log, "ab") if log is not None else contextlib.nullcontext() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                start_new_session=new_session, preexec_fn=die_with_parent)
    return Child(name, proc, log)


def spawn_role(role: str, *args: str, name: str | None = None, env: Mapping[str, str] | None = None,
               log: Path | None = None, new_session: bool = False) -> Child:
    """:func:`spawn` of ``tokenpipe <role> <args>`` (generator, relay, nats ...), with this
    interpreter (no PATH lookup)."""
    return spawn(name or role, [sys.executable, "-m", "tokenpipe_cli", role, *args], env=env, log=log,
                 new_session=new_session)


def stop_all(children: Sequence[Child], timeout: float = 20.0) -> None:
    """SIGTERM every child at once, then wait for each (SIGKILL after ``timeout`` s)."""
    for child in children:
        child.terminate()
    for child in children:
        child.wait_or_kill(timeout)


def http_ok(url: str, timeout: float = 2.0) -> Callable[[], bool]:
    """A readiness check: ``GET url`` answers 200 (a relay answers /readyz 503 until a generator
    has announced itself)."""

    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False  # not listening yet, or not ready

    return check


def tcp_listening(host: str, port: int, timeout: float = 0.2) -> Callable[[], bool]:
    """A readiness check: something accepts TCP connections on ``host:port``."""

    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False

    return check


def wait_ready(ready: Callable[[], bool], *, timeout: float, what: str, children: Sequence[Child] = (),
               interval: float = 0.2) -> None:
    """Poll ``ready`` until it holds. Raises :class:`LaunchError` when one of ``children`` exits
    meanwhile, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        dead = next((c for c in children if c.proc.poll() is not None), None)
        if dead is not None:
            name = dead.name + (f" (log: {dead.log})" if dead.log else "")
            raise LaunchError(f"{name} exited with {dead.proc.returncode} while waiting for {what}")
        if ready():
            return
        if time.monotonic() > deadline:
            logs = ", ".join(str(c.log) for c in children if c.log)
            raise LaunchError(f"{what} not ready within {timeout:g}s" + (f"; see {logs}" if logs else ""))
        time.sleep(interval)  # polling a child process: there is no event to wait on
