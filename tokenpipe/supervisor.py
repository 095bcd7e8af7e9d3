"""``tokenpipe up``: a real nats-server, N generator processes and a relay, on one machine."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from .cluster import LocalCluster
from .natsserver import NatsServer, die_with_parent, free_port
from .settings import Settings

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class Supervisor:
    settings: Settings
    generators: int = 1
    nats_port: int = 4222
    external_nats: bool = False
    nats_cluster: int = 1  # > 1: that many nats-server nodes on loopback, one JetStream cluster
    ready_timeout: float = 600.0
    children: list[_Child] = field(default_factory=list)
    nats: NatsServer | LocalCluster | None = None
    _stop_signal: int | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "tokenpipe", *args]
        # Own session: Ctrl-C reaches only us, and we stop roles in order (relay, generators, NATS).
        proc = subprocess.Popen(cmd, start_new_session=True, env=os.environ.copy(), preexec_fn=die_with_parent)
        self.children.append(_Child(name, proc))

    def run(self) -> int:
        s = self.settings
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        nats_url = s.nats_url
        try:
            if not self.external_nats:
                port = self.nats_port if _port_free(self.nats_port) else free_port()
                if self.nats_cluster > 1:
                    self.nats = LocalCluster(Path(s.data_dir) / "nats-cluster", self.nats_cluster,
                                             first_port=port).start()
                else:
                    self.nats = NatsServer(Path(s.data_dir) / "nats", port=port).start()
                nats_url = self.nats.url
            self._prepare_model()
            common = ["--nats-url", nats_url, "--data-dir", s.data_dir, "--log-level", s.log_level]
            for i in range(self.generators):
                metrics_port = s.metrics_port + i if s.metrics_port > 0 else 0
                self._spawn(f"generator-{i}", ["generator", *common, "--model", s.model, "--device", s.device,
                                               "--metrics-port", str(metrics_port),
                                               *(["--model-path", s.model_path] if s.model_path else [])])
            self._spawn("relay", ["relay", *common, "--host", s.host, "--port", str(s.port)])
            url = f"http://{s.host}:{s.port}"
            if self._wait_ready(url):
                print(f"\ntokenpipe is up: {url}   (NATS {nats_url}; Ctrl-C stops)\n", flush=True)
                while self._stop_signal is None:
                    dead = [c for c in self.children if c.proc.poll() is not None]
                    if dead:
                        log.error("a role exited; stopping", extra={"role": dead[0].name,
                                                                     "code": dead[0].proc.returncode})
                        return 1
                    time.sleep(0.2)  # supervisor poll; signals interrupt it
            return 0 if self._stop_signal is not None else 1
        finally:
            self.shutdown()

    def _prepare_model(self) -> None:
        # De-quantize once here, with a progress bar, rather than N times in parallel.
        if self.settings.model_path:
            return
        from generator.models import BUILTIN_MODELS, prepare_smollm2

        if self.settings.model in BUILTIN_MODELS:
            prepare_smollm2(self.settings.data_dir)

    def _wait_ready(self, url: str) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline and self._stop_signal is None:
            if any(c.proc.poll() is not None for c in self.children):
                return False
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 until a generator announces itself
            time.sleep(0.25)  # readiness poll of child processes
        return False

    def shutdown(self) -> None:
        order = sorted(self.children, key=lambda c: 0 if c.name == "relay" else 1)
        for child in order:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            if child.name == "relay":
                _wait(child.proc, 10)
        for child in order:
            _wait(child.proc, self.settings.drain_timeout_s + 10)
        if self.nats is not None:
            self.nats.stop()
        self.children.clear()


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
