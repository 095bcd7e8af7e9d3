"""A whole pipeline for a benchmark's lifetime: nats-server, one generator process, one relay process."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from tokenpipe_cli.launch import Child, LaunchError, free_port, http_ok, spawn, spawn_role, stop_all, wait_ready
from tokenpipe_cli.natsserver import NatsServer

__all__ = ["Pipeline"]


class Pipeline:
    """Use as a context manager; ``url`` is the relay's. Role logs go to a temporary directory."""

    def __init__(self, model: str, data_dir: str, extra_env: dict[str, str] | None = None,
                 device: str = "auto", dtype: str = "auto", ready_timeout: float = 300.0,
                 launcher: str = "tokenpipe_cli") -> None:
        self.model = model
        self.launcher = launcher  # the module run as ``python -m <launcher> generator ...`` (a bench's variant)
        self.data_dir = data_dir
        self.device = device
        self.dtype = dtype
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(extra_env or {})}
        self.tmp = tempfile.TemporaryDirectory(prefix="tokenpipe-bench-")
        self.nats = NatsServer(Path(self.tmp.name) / "nats")
        self.port = free_port()
        self.generator: Child | None = None
        self.relay: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Pipeline:
        self.nats.start()
        common = ["--nats-url", self.nats.url, "--data-dir", self.data_dir, "--log-level", "WARNING"]
        logs = Path(self.tmp.name)
        try:
            self.generator = spawn("generator", [sys.executable, "-m", self.launcher, "generator", *common,
                                                 "--model", self.model, "--device", self.device, "--dtype", self.dtype],
                                   env=self.env, log=logs / "generator.log")
            self.relay = spawn_role("relay", *common, "--port", str(self.port), env=self.env, log=logs / "relay.log")
            wait_ready(http_ok(f"{self.url}/readyz"), timeout=self.ready_timeout, what="the benchmark's pipeline",
                       children=[self.generator, self.relay])
        except LaunchError as exc:
            tails = _log_tails([self.generator, self.relay])  # before __exit__ removes the logs
            self.__exit__()
            raise LaunchError(f"{exc.message}\n{tails}") from exc
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all([c for c in (self.generator, self.relay) if c is not None])
        self.nats.stop()
        self.tmp.cleanup()


def _log_tails(children: list[Child | None], lines: int = 20) -> str:
    out = []
    for child in children:
        if child is not None and child.log is not None and child.log.exists():
            tail = child.log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {child.name} ---\n" + "\n".join(tail))
    return "\n".join(out)
