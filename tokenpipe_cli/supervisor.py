"""``tokenpipe up``: a real nats-server, N generator processes and a relay, on one machine."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from tokenpipe.natsauth import write_server_config
from tokenpipe.settings import Settings

from .launch import Child, LaunchError, free_port, http_ok, port_free, spawn_role, wait_ready
from .natsserver import NatsServer

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)


@dataclass
class Supervisor:
    settings: Settings
    generators: int = 1
    nats_port: int = 4222
    external_nats: bool = False
    ready_timeout: float = 600.0
    children: list[Child] = field(default_factory=list)
    nats: NatsServer | None = None
    _stop_signal: int | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def _spawn(self, name: str, args: list[str]) -> None:
        # Own session: Ctrl-C reaches only us, and we stop roles in order (relay, generators, NATS).
        self.children.append(spawn_role(args[0], *args[1:], name=name, new_session=True))

    def run(self) -> int:
        s = self.settings
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        nats_url = s.nats_url
        creds: dict[str, list[str]] = {}  # per role: its credentials (the embedded server's)
        try:
            if not self.external_nats:
                port = self.nats_port if port_free(self.nats_port) else free_port()
                creds_dir = Path(s.data_dir) / "creds"
                # Authorization on, even on loopback: every role gets its own user (tokenpipe.natsauth).
                conf = write_server_config(Path(s.data_dir) / "nats" / "nats-server.conf", creds_dir)
                self.nats = NatsServer(Path(s.data_dir) / "nats", port=port, config_file=conf).start()
                nats_url = self.nats.url
                creds = {role: ["--nats-creds", str(creds_dir / f"{role}.json")] for role in ("relay", "generator")}
            self._prepare_model()
            common = ["--nats-url", nats_url, "--data-dir", s.data_dir, "--log-level", s.log_level]
            for i in range(self.generators):
                metrics_port = s.metrics_port + i if s.metrics_port > 0 else 0
                self._spawn(f"generator-{i}", ["generator", *common, *creds.get("generator", []), "--model", s.model,
                                               "--device", s.device, "--metrics-port", str(metrics_port),
                                               *(["--model-path", s.model_path] if s.model_path else [])])
            self._spawn("relay", ["relay", *common, *creds.get("relay", []), "--host", s.host, "--port", str(s.port)])
            url = f"http://{s.host}:{s.port}"
            if self._wait_ready(url):
                where = f"NATS {nats_url}, credentials in {s.data_dir}/creds" if creds else f"NATS {nats_url}"
                print(f"\ntokenpipe is up: {url}   ({where}; Ctrl-C stops)\n", flush=True)
                while self._stop_signal is None:
                    dead = [c for c in self.children if c.returncode is not None]
                    if dead:
                        log.error("a role exited; stopping", extra={"role": dead[0].name,
                                                                     "code": dead[0].returncode})
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
        try:
            return wait_ready(http_ok(f"{url}/readyz"), timeout=self.ready_timeout, what=f"the relay at {url}",
                              children=self.children, interval=0.25,
                              cancelled=lambda: self._stop_signal is not None)
        except LaunchError as exc:
            log.error("tokenpipe did not come up; stopping", extra={"reason": exc.message})
            return False

    def shutdown(self) -> None:
        # The relay first (no new work, its streams end), then the generators drain together.
        order = sorted(self.children, key=lambda c: 0 if c.name == "relay" else 1)
        for child in order:
            child.terminate()
            if child.name == "relay":
                child.wait_or_kill(10)
        for child in order:
            child.wait_or_kill(self.settings.drain_timeout_s + 10)
        if self.nats is not None:
            self.nats.stop()
        self.children.clear()
