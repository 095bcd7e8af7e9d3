"""The processes a benchmark runs against, for its lifetime: a whole pipeline (nats-server, one generator
process, one relay process), or relays alone on a fresh nats-server (fed by a synthetic source)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenpipe.natsconfig import write_server_config
from tokenpipe.settings import Settings
from tokenpipe_cli.launch import Child, LaunchError, free_port, http_ok, spawn_role, stop_all, wait_ready
from tokenpipe_cli.natsserver import NatsServer
from tokenpipe_cli.provisioner import Provisioner

__all__ = ["Pipeline", "Relays"]


class Pipeline:
    """Use as a context manager; ``url`` is the relay's. Role logs go to a temporary directory. ``auth``:
    NATS authorization as ``tokenpipe up`` serves it (tokenpipe's accounts, the relay in its own, the
    admin's provisioner, each role on its own credentials); else an open bus."""

    def __init__(self, model: str, data_dir: str, extra_env: dict[str, str] | None = None,
                 device: str = "auto", dtype: str = "auto", ready_timeout: float = 300.0, auth: bool = False) -> None:
        self.model = model
        self.data_dir = data_dir
        self.device = device
        self.dtype = dtype
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(extra_env or {})}
        self.tmp = tempfile.TemporaryDirectory(prefix="tokenpipe-bench-")
        self.creds = Path(self.tmp.name) / "creds" if auth else None
        conf = write_server_config(Path(self.tmp.name) / "nats.conf", self.creds) if self.creds else None
        self.nats = NatsServer(Path(self.tmp.name) / "nats", config_file=conf)
        self.port = free_port()
        self.generator: Child | None = None
        self.relay: Child | None = None
        self.admin: Provisioner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Pipeline:
        self.nats.start()
        common = ["--nats-url", self.nats.url, "--data-dir", self.data_dir, "--log-level", "WARNING"]
        logs = Path(self.tmp.name)
        try:
            if self.creds is not None:
                settings = Settings.load(env={}, data_dir=self.data_dir, model=self.model)
                self.admin = Provisioner(settings, self.nats.url, self.creds / "admin.json").start()
            gen, relay = ([["--nats-creds", str(self.creds / f"{role}.json")] if self.creds else []
                           for role in ("generator", "relay")])
            self.generator = spawn_role("generator", *common, *gen, "--model", self.model, "--device", self.device,
                                        "--dtype", self.dtype, env=self.env, log=logs / "generator.log")
            self.relay = spawn_role("relay", *common, *relay, "--port", str(self.port), env=self.env,
                                    log=logs / "relay.log")
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
        if self.admin is not None:
            self.admin.stop()
        self.nats.stop()
        self.tmp.cleanup()


class Relays:
    """``count`` relay processes on a fresh nats-server, each ready (``/healthz``) on entry; ``ports`` and
    ``children`` in the same order. The relays share the server's temporary data dir, ``data_dir``."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.tmp = tempfile.TemporaryDirectory(prefix="tokenpipe-bench-")
        self.data_dir = self.tmp.name
        self.nats = NatsServer(Path(self.tmp.name) / "nats")
        self.ports = [free_port() for _ in range(count)]
        self.children: list[Child] = []

    def __enter__(self) -> Relays:
        try:
            self.nats.start()
            for i, port in enumerate(self.ports):
                self.children.append(spawn_role("relay", "--nats-url", self.nats.url, "--data-dir", self.data_dir,
                                                "--port", str(port), "--log-level", "WARNING", name=f"relay-{i}"))
            for port, child in zip(self.ports, self.children, strict=True):
                wait_ready(http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=60,
                           what=f"the benchmark's {child.name}", children=[child])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self.children, timeout=30)
        self.nats.stop()
        self.tmp.cleanup()

    @property
    def nats_pid(self) -> int:
        assert self.nats.pid is not None  # started on entry
        return self.nats.pid


def _log_tails(children: list[Child | None], lines: int = 20) -> str:
    out = []
    for child in children:
        if child is not None and child.log is not None and child.log.exists():
            tail = child.log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {child.name} ---\n" + "\n".join(tail))
    return "\n".join(out)
