"""``tokenpipe up``: a real nats-server, N generator processes and a relay on one machine, kept running.

One loop polls the children and restarts a role that exits unexpectedly (the policy and
``up.json``: :mod:`tokenpipe_cli.uprole`). Giving up on nats-server, the relay or the last
generator stops the stack (exit 1); one generator of several down only degrades it. Only
SIGINT/SIGTERM stops everything, in order: the relay, the generators (draining), NATS last.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from tokenpipe.cluster import parse_replicas
from tokenpipe.errors import TokenpipeError, TransportError
from tokenpipe.natsconfig import write_server_config
from tokenpipe.settings import Settings, engine_threads

from .cluster import LocalCluster
from .forkserver import ForkServer
from .launch import Child, free_port, http_ok, port_free, spawn_role
from .natsserver import NatsServer
from .provisioner import Provisioner
from .uprole import Role, RoleKind, describe_exit, write_status

__all__ = ["Supervisor", "nats_role"]

log = logging.getLogger(__name__)

_POLL_S = 0.2
_START_POLL_S = 0.05  # while starting: a generator's ready file seen within 50 ms, not 200 (a warm start is ~2.5 s)
_READY_TIMEOUT_S = 600.0


class _GiveUp(Exception):
    """The stack cannot go on: the exit status ``tokenpipe up`` returns is 1."""


@dataclass
class Supervisor:
    settings: Settings
    generators: int = 1
    nats_port: int | None = None  # None: 4222, or a free port when that is taken
    external_nats: bool = False
    metrics_port_chosen: bool = False  # TOKENPIPE_METRICS_PORT given: a taken one is then an error
    nats_cluster: int = 1  # > 1: that many nats-server nodes on loopback, one JetStream cluster
    nats: NatsServer | LocalCluster | None = None
    provisioner: Provisioner | None = None  # the admin: creates and repairs the streams (embedded NATS)
    # Forks the generators (TOKENPIPE_FORK_GENERATORS); `tokenpipe up` starts one before it imports anything
    # (tokenpipe_cli.main): used here, or stopped if no generator is forked.
    forks: ForkServer | None = None
    roles: list[Role] = field(default_factory=list)
    _stop_signal: int | None = None
    _state: str = "starting"
    _ports: dict[str, Any] = field(default_factory=dict)
    _shown: str = ""

    @property
    def _gate(self) -> Path:
        """The file that lets the generators connect (``TOKENPIPE_START_GATE``): written once the streams exist."""
        return Path(self.settings.data_dir) / "run" / "streams.ready"

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    # -- ports ------------------------------------------------------------------------
    def _port(self, what: str, wanted: int, explicit: bool) -> int:
        if port_free(wanted, self.settings.host if what == "relay" else "127.0.0.1"):
            return wanted
        if explicit:
            raise TransportError(f"{what} port {wanted} is already in use (another tokenpipe up?); choose another")
        chosen = free_port()
        log.warning("default port taken; using a free one", extra={"what": what, "default": wanted, "port": chosen})
        print(f"tokenpipe: {what} port {wanted} is taken; using {chosen}", flush=True)
        return chosen

    # -- roles ------------------------------------------------------------------------
    def _child_role(self, name: str, kind: RoleKind, args: list[str], ready: Callable[[], bool],
                    env: dict[str, str] | None = None) -> Role:
        # Own session: Ctrl-C reaches only us, and we stop roles in order (relay, generators, NATS).
        if kind == "generator" and self.settings.fork_generators:
            return Role(name, kind, partial(self._fork, name, args, env), ready)
        return Role(name, kind, partial(spawn_role, *args, name=name, new_session=True, env=env), ready)

    def _fork(self, name: str, args: list[str], env: dict[str, str] | None) -> Child:
        """A generator forked from the fork server (a new one if the last one died; spawned if it never started)."""
        if self.forks is not None and self.forks.broken:
            return spawn_role(*args, name=name, new_session=True, env=env)
        if self.forks is None or not self.forks.alive:
            if self.forks is not None:
                log.warning("the fork server exited; starting another", extra={"exit": self.forks.proc.poll()})
            self.forks = ForkServer()
        return self.forks.spawn(name, args, env, new_session=True)

    def _nats_roles(self, port: int) -> list[Role]:
        # Authorization on, even on loopback: every role gets its own user (tokenpipe.natsauth);
        # the nodes of a local cluster share one configuration (the same users everywhere).
        data = Path(self.settings.data_dir)
        conf = write_server_config(data / "nats" / "nats-server.conf", data / "creds", settings=self.settings)
        if self.nats_cluster > 1:
            cluster = self.nats = LocalCluster(data / "nats-cluster", self.nats_cluster, first_port=port,
                                               config_file=conf)
            # One role per node: each is restarted on its own ports and store, like a single server.
            return [nats_role(node, f"nats-server-{i}") for i, node in enumerate(cluster.nodes)]
        self.nats = NatsServer(data / "nats", port=port, config_file=conf)
        return [nats_role(self.nats, "nats-server")]

    def _build_roles(self) -> None:
        s = self.settings
        nats_url = s.nats_url
        if not self.external_nats:
            port = self._port("NATS", self.nats_port or 4222, self.nats_port is not None)
            self.roles.extend(self._nats_roles(port))
            nats_url = self.nats.url if self.nats is not None else f"nats://127.0.0.1:{port}"
            self._ports["nats"] = port
        self._ports["nats_url"] = nats_url
        relay_port = self._port("relay", s.port, True)  # the page's address never moves silently
        self._ports["relay"] = relay_port
        self._ports["relay_url"] = f"http://{s.host}:{relay_port}"
        common = ["--nats-url", nats_url, "--data-dir", s.data_dir, "--log-level", s.log_level,
                  *(["--log-json"] if s.log_json else [])]

        def nats_args(role: str) -> list[str]:
            if self.external_nats:  # what `up` was given for that server
                given = {"--nats-creds": s.nats_creds, "--nats-user": s.nats_user, "--nats-ca": s.nats_ca,
                         "--nats-cert": s.nats_cert, "--nats-key": s.nats_key}
                return [arg for flag, value in given.items() if value for arg in (flag, value)]
            return ["--nats-creds", str(Path(s.data_dir) / "creds" / f"{role}.json")]  # the embedded server's, per role

        metrics: list[int] = []
        # The machine's cores shared out: N generators each as wide as the machine spin on each other's
        # cores at every OpenMP barrier.
        threads = {} if s.threads > 0 else {"TOKENPIPE_THREADS": str(engine_threads(0, generators=self.generators))}
        # The generators start with NATS and load while the admin sets the streams up; they connect once
        # this file says the streams exist (a restarted one finds it there).
        gate: dict[str, str] = {}
        if not self.external_nats:
            self._gate.parent.mkdir(parents=True, exist_ok=True)
            self._gate.unlink(missing_ok=True)
            gate["TOKENPIPE_START_GATE"] = str(self._gate)
        for i in range(self.generators):
            mport = 0
            if s.metrics_port > 0:
                mport = self._port(f"generator-{i} metrics", s.metrics_port + i, self.metrics_port_chosen)
                metrics.append(mport)
            ready_file = Path(s.data_dir) / "run" / f"generator-{i}.ready"
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.unlink(missing_ok=True)
            self.roles.append(self._child_role(
                f"generator-{i}", "generator",
                ["generator", *common, *nats_args("generator"), "--model", s.model, "--device", s.device,
                 "--dtype", s.dtype, "--quant", s.quant, "--metrics-port", str(mport),
                 *(["--model-path", s.model_path] if s.model_path else [])],
                self._ready_file_check(f"generator-{i}", ready_file),
                # Slot i: a generator restarted after a crash holds its slot again, and the requests
                # placed there meanwhile went to the others (tokenpipe.placement).
                env={**os.environ, **threads, **gate, "TOKENPIPE_READY_FILE": str(ready_file),
                     "TOKENPIPE_PLACEMENT_SLOT": str(i)}))
        self._ports["metrics"] = metrics
        self.roles.append(self._child_role(
            "relay", "relay", ["relay", *common, *nats_args("relay"), "--model", s.model, "--host", s.host,
                                "--port", str(relay_port)],
            http_ok(f"{self._ports['relay_url']}/healthz", timeout=1.0),
            env={**os.environ, "TOKENPIPE_EXPECTED_GENERATORS": str(self.generators)}))

    def _admin_settings(self) -> Settings:
        """The provisioner's settings. ``auto`` replicas are resolved from the connected server's view
        of its cluster, which a local cluster that is still forming does not show yet: the
        supervisor knows its size."""
        if self.nats_cluster > 1 and parse_replicas(self.settings.replicas) is None:
            return self.settings.replace(replicas="3" if self.nats_cluster >= 3 else "1")
        return self.settings

    def _ready_file_check(self, name: str, path: Path) -> Callable[[], bool]:
        def check() -> bool:
            try:
                pid, port = (int(v) for v in f"{path.read_text()} 0".split()[:2])  # "pid metrics-port"
            except (OSError, ValueError):
                return False
            role = next(r for r in self.roles if r.name == name)
            if pid != role.pid:
                return False  # a stale file of a killed predecessor does not count
            self._metrics_port_is(int(name.rsplit("-", 1)[1]), port)
            return True

        return check

    def _metrics_port_is(self, generator: int, port: int) -> None:
        """A generator serves its /metrics on ``port`` (its ready file says so): up.json follows where the
        port it was given had been taken meanwhile."""
        ports = self._ports.get("metrics", [])
        if port > 0 and generator < len(ports) and ports[generator] != port:
            log.warning("a generator's metrics port was taken; it serves another",
                        extra={"role": f"generator-{generator}", "wanted": ports[generator], "port": port})
            ports[generator] = port
            self._write_status()

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        forking = self.settings.fork_generators and self.generators > 0
        if self.forks is not None and not forking:
            self.forks.discard()
            self.forks = None
        try:
            self._build_roles()
        except TokenpipeError as exc:
            print(f"tokenpipe: error: {exc.message}", flush=True)
            if self.forks is not None:
                self.forks.discard()
            return 1
        if forking and self.forks is None:
            # First: it imports torch and the engine while nats-server starts and the streams are set up.
            self.forks = ForkServer()
        try:
            for nats in (r for r in self.roles if r.kind == "nats"):  # one, or a local cluster's nodes
                self._start(nats)
                if nats.pid == -1:
                    return 1
            self._prepare_model()
            if not self.external_nats:
                # Only the admin configures streams. The generators load their model meanwhile and connect
                # once the gate file says the streams exist; the relay starts after.
                for role in self.roles:
                    if role.kind == "generator":
                        self._start(role)
                try:
                    self.provisioner = Provisioner(self._admin_settings(), self._ports["nats_url"],
                                                   Path(self.settings.data_dir) / "creds" / "admin.json").start()
                except TokenpipeError as exc:
                    print(f"tokenpipe: error: {exc.message}", flush=True)
                    return 1
                self._gate.write_text("streams provisioned\n")
            for role in self.roles:
                if role.kind != "nats" and role.child is None:
                    self._start(role)
            self._write_status()
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while self._stop_signal is None:
                self._tick()
                if self._state == "starting" and time.monotonic() > deadline:
                    log.error("tokenpipe did not come up in time; stopping", extra={"timeout_s": _READY_TIMEOUT_S})
                    return 1
                # Polling child processes: signals interrupt it.
                time.sleep(_START_POLL_S if self._state == "starting" else _POLL_S)
            return 0
        except _GiveUp:
            return 1
        finally:
            self._state = "stopping"
            self._write_status()
            self.shutdown()
            self._state = "stopped" if self._stop_signal is not None else "failed"
            for role in self.roles:
                role.state = "stopped" if role.state != "failed" else "failed"
            self._write_status()

    def _start(self, role: Role) -> None:
        role.state = "starting"
        role.child = role.start()
        role.pid = role.child.pid_now() if role.child is not None else -1
        log.info("role started", extra={"role": role.name, "pid": role.pid, "restarts": role.restarts})

    def _tick(self) -> None:
        s = self.settings
        now = time.monotonic()
        changed = False
        for role in self.roles:
            if role.state == "failed":
                continue
            if role.state == "restarting":
                if now >= role.restart_at:
                    role.restarts += 1
                    self._start(role)
                    changed = True
                continue
            if role.pid is None and role.child is not None:  # a fork's pid, answered since
                role.pid = role.child.pid_now()
                changed = changed or role.pid is not None
            code = role.alive()
            if code is not None:
                changed = True
                delay = role.exited(code, now, s)
                if delay is None:
                    log.error("role keeps crashing; giving up on it",
                              extra={"role": role.name, "exit": describe_exit(code), "restarts": role.restarts,
                                     "limit": s.restart_limit, "window_s": s.restart_window_s})
                    print(f"tokenpipe: giving up on {role.name}: it exited ({describe_exit(code)}) "
                          f"{len(role.recent)} times within {s.restart_window_s:g}s", flush=True)
                    self._check_viable(role)
                    continue
                log.warning("role exited; restarting", extra={"role": role.name, "exit": describe_exit(code),
                                                              "restarts": role.restarts, "backoff_s": delay})
                print(f"tokenpipe: {role.name} exited ({describe_exit(code)}); restarting in {delay:g}s "
                      f"(restart {role.restarts + 1})", flush=True)
            elif role.state == "starting" and role.ready_check():
                role.state = "ready"
                changed = True
                log.info("role ready", extra={"role": role.name, "pid": role.pid})
            elif role.state == "ready" and role.kind == "generator" and not role.ready_check():
                role.state = "starting"  # its ready file went away: it is stopping
                changed = True
        if changed:
            self._on_change()
        if self._state == "starting":
            self._maybe_up()

    def _maybe_up(self) -> None:
        gens_ready = any(r.state == "ready" for r in self.roles if r.kind == "generator")
        others_ready = all(r.state == "ready" for r in self.roles if r.kind != "generator")
        # /readyz too: the relay has heard a generator announce itself, so the first request is served.
        if gens_ready and others_ready and http_ok(f"{self._ports['relay_url']}/readyz", timeout=1.0)():
            self._state = "up"
            self._on_change()  # up.json says "up" before the line that tells a user (or a test) so
            where = f"NATS {self._ports['nats_url']}" + ("" if self.external_nats else
                                                          f", credentials in {self.settings.data_dir}/creds")
            print(f"\ntokenpipe is up: {self._ports['relay_url']}   ({where}; Ctrl-C stops)\n",
                  flush=True)

    def _check_viable(self, failed: Role) -> None:
        if failed.kind in ("nats", "relay"):
            raise _GiveUp
        if all(r.state == "failed" for r in self.roles if r.kind == "generator"):
            log.error("no generator is left; stopping")
            raise _GiveUp

    def _on_change(self) -> None:
        gens = [r for r in self.roles if r.kind == "generator"]
        ready = sum(r.state == "ready" for r in gens)
        line = f"generators: {ready}/{len(gens)} ready"
        down = [f"{r.name} {r.state}" for r in self.roles if r.kind != "generator" and r.state != "ready"]
        if down:
            line += "; " + ", ".join(down)
        if line != self._shown and self._state != "starting":
            self._shown = line
            print(f"tokenpipe: {line}", flush=True)
        self._write_status()

    def _write_status(self) -> None:
        gens = [r for r in self.roles if r.kind == "generator"]
        body = {"pid": os.getpid(), "state": self._state, "relay_url": self._ports.get("relay_url"),
                "nats_url": self._ports.get("nats_url"),
                "ports": {k: self._ports.get(k) for k in ("relay", "nats", "metrics")},
                "generators": f"{sum(r.state == 'ready' for r in gens)}/{len(gens)}",
                "roles": [r.status() for r in self.roles]}
        write_status(self.settings.data_dir, body)

    def _prepare_model(self) -> None:
        # Once here, with a progress bar, rather than N times in parallel; only what the model needs.
        if self.settings.model_path:
            return
        from generator.model.preparation import BUILTIN_MODELS, prepare_tokenizer  # no torch: a warm start's ~1.5 s

        if self.settings.model in BUILTIN_MODELS:  # SmolLM2's weights are read from its GGUF file by each generator
            prepare_tokenizer(self.settings.data_dir)

    def shutdown(self) -> None:
        # Every role is asked at once; the relay is waited for first (no new work, its streams end),
        # while the generators drain together.
        children = [r.child for r in self.roles if r.kind != "nats" and r.child is not None]
        for child in children:
            child.terminate()
        for child in children:
            if child.name == "relay":
                child.wait_or_kill(10)
        for child in children:
            child.wait_or_kill(self.settings.drain_timeout_s + 10)
        if self.forks is not None:
            self.forks.close()
        if self.provisioner is not None:
            self.provisioner.stop()
        if self.nats is not None:
            self.nats.stop()


def nats_role(nats: NatsServer, name: str) -> Role:
    """The role of one nats-server (or one node of a local cluster) under ``tokenpipe up``: its first
    start waits until it serves; a restart does not (the role is ready once it listens)."""
    def start() -> Child | None:
        if nats.child is not None:
            # A restart (same port, same store: file storage keeps every queued request and batch):
            # not waited for here. After a kill -9 the node recovers its store before it listens,
            # which on a busy machine took longer than a start's bound, and each such "failed"
            # start counted towards the crash-loop limit that then stopped the whole stack.
            nats.child = None
            return nats.spawn()
        try:
            nats.start()  # the first start: the provisioner and the roles need it serving
        except TransportError as exc:
            log.error("nats-server did not start", extra={"reason": exc.message})
            return None
        return nats.child

    return Role(name, "nats", start, nats.listening)
