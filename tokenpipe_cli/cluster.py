"""Clustered nats-server nodes: one node's flags (``tokenpipe nats --cluster-name ...``) and a
local N-node JetStream cluster on loopback (``tokenpipe up --nats-cluster 3``, the fault tests,
``bench.replication``), inspected through the nodes' monitoring endpoints (meta leader, stream
leaders, health). Every node gets the same authorization config as a single embedded server
(:func:`tokenpipe.natsauth.write_server_config`); routes between the nodes carry a route
user of their own (:meth:`ClusterArgs.config_block`)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenpipe.errors import ConfigError, TransportError
from tokenpipe.natsauth import write_private

from .launch import free_ports
from .natsserver import NatsServer

__all__ = ["ClusterArgs", "LocalCluster", "node_args"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterArgs:
    """What makes one nats-server a node of a JetStream cluster: JetStream clustering needs a
    cluster name and a unique server name; ``routes`` are the other nodes' ``nats-route://`` URLs."""

    name: str
    port: int
    server_name: str
    routes: tuple[str, ...] = ()
    # Routes authenticated with this user (every node's routes carry it).
    route_user: str = ""
    route_password: str = ""

    def argv(self, host: str) -> list[str]:
        out = ["--cluster_name", self.name, "--cluster", f"nats://{host}:{self.port}", "--server_name",
               self.server_name]
        if self.routes:
            out += ["--routes", ",".join(self.routes)]
        return out

    def config_block(self, host: str) -> str:
        """The node's ``server_name`` and nats-server's ``cluster`` block: routes accepted only with
        the route user's password (when there is one) and the other nodes dialled with it; route
        pings every second, three unanswered drop the route. With nats-server's default (two
        minutes) the other nodes kept their routes to a frozen node, and a JetStream request that
        went through it waited for the thaw: every stream stalled as long as the freeze (a node frozen
        20 s: 21 s against 9.7 s with these pings)."""
        auth = f"{self.route_user}:{self.route_password}@" if self.route_user else ""
        routes = [u.replace("://", f"://{auth}", 1) for u in self.routes]
        lines = [f"  name: {json.dumps(self.name)}", f"  listen: {json.dumps(f'{host}:{self.port}')}"]
        if self.route_user:
            user, password = json.dumps(self.route_user), json.dumps(self.route_password)
            lines.append(f"  authorization {{ user: {user}, password: {password} }}")
        lines += [f"  routes: {json.dumps(routes)}", '  ping_interval: "1s"', "  ping_max: 3"]
        return f"server_name: {json.dumps(self.server_name)}\ncluster {{\n" + "\n".join(lines) + "\n}\n"


def node_args(cluster_name: str, cluster_port: int, routes: str, server_name: str | None) -> ClusterArgs:
    """``tokenpipe nats --cluster-name N --cluster-port P --routes URL,URL --server-name S``, checked."""
    if not server_name:
        raise ConfigError("a clustered node needs --server-name (unique in the cluster)", param="server_name")
    urls = tuple(u.strip() for u in routes.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("nats-route://", "nats://")):
            raise ConfigError(f"route {url!r} is not a nats-route://host:port URL", param="routes")
    return ClusterArgs(name=cluster_name, port=cluster_port, server_name=server_name, routes=urls)


class LocalCluster:
    """N nats-server processes on loopback forming one JetStream cluster, each with its own store
    under ``data_dir/<server name>`` and a monitoring port; start/stop as a whole or node by node."""

    def __init__(self, data_dir: str | os.PathLike[str], size: int = 3, *, host: str = "127.0.0.1",
                 name: str = "tokenpipe", first_port: int | None = None,
                 config_file: str | os.PathLike[str] | None = None) -> None:
        """``config_file``: the configuration every node includes, with its ``cluster`` block, in
        ``data_dir/<server name>/nats-server.conf``."""
        if size < 1:
            raise ConfigError("a cluster needs at least one node", param="nats_cluster")
        chosen = [p for p in free_ports(3 * size + 1, host) if p != first_port][:3 * size]
        ports = [first_port or chosen[0], *chosen[1:size]]
        route_ports, monitor_ports = chosen[size:2 * size], chosen[2 * size:]
        self.nodes: list[NatsServer] = []
        self.names = [f"{name}-{i}" for i in range(size)]  # the nodes' server names
        # The route user's password lives as long as this object: every node is restarted from it.
        password = secrets.token_urlsafe(24) if config_file is not None else ""
        for i in range(size):
            routes = tuple(f"nats-route://{host}:{p}" for j, p in enumerate(route_ports) if j != i)
            args = ClusterArgs(name=name, port=route_ports[i], server_name=self.names[i], routes=routes,
                               route_user="route" if password else "", route_password=password)
            node_dir = Path(data_dir) / args.server_name
            node_dir.mkdir(parents=True, exist_ok=True)
            conf = node_dir / "nats-server.conf"
            include = ""
            if config_file is not None:
                # Included, not copied: what it includes in turn (the accounts, which `tokenpipe
                # creds add-app` rewrites and reloads) resolves against its own directory.
                include = f"include {json.dumps(os.path.relpath(Path(config_file).resolve(), node_dir.resolve()))}\n"
            write_private(conf, include + args.config_block(host))  # it holds passwords
            # Configured by its config file alone: the command line cannot set the route pings.
            self.nodes.append(NatsServer(node_dir, host=host, port=ports[i], monitor_port=monitor_ports[i],
                                         config_file=conf))

    @property
    def url(self) -> str:
        """The seed list to give every role (``TOKENPIPE_NATS_URL``)."""
        return ",".join(n.url for n in self.nodes)

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start(timeout)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("nats cluster ready", extra={"url": self.url, "nodes": len(self.nodes)})
        return self

    def stop(self) -> None:
        for i, node in enumerate(self.nodes):
            self.thaw(i)  # a frozen process cannot act on SIGTERM
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self, i: int) -> None:
        """``kill -9`` node ``i`` (no lame duck, no leader hand-over) and reap it."""
        node = self.nodes[i]
        child, node.child = node.child, None
        if child is not None:
            child.kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Stop node ``i`` (SIGTERM) and start it again on the same ports and store; returns once it
        listens (see :meth:`wait_healthy` for caught up)."""
        self.thaw(i)  # a frozen process cannot act on SIGTERM
        self.nodes[i].stop()
        self.nodes[i].start(timeout)

    def start_node(self, i: int, timeout: float = 30.0) -> None:
        self.nodes[i].start(timeout)

    def freeze(self, i: int) -> None:
        """SIGSTOP node ``i``: its sockets stay open but nothing answers (a hung host)."""
        self._signal(i, signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: signal.Signals) -> None:
        child = self.nodes[i].child
        if child is not None and child.returncode is None:
            child.proc.send_signal(sig)

    def running(self, i: int) -> bool:
        child = self.nodes[i].child
        return child is not None and child.returncode is None

    # -- inspection (monitoring endpoints) ----------------------------------------------
    def monitor(self, i: int, path: str, timeout: float = 2.0) -> Any:
        """GET ``path`` (e.g. ``/jsz?streams=true``) from node ``i``'s monitoring port, as JSON."""
        node = self.nodes[i]
        url = f"http://{node.host}:{node.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # /healthz answers 503 with a JSON body
            return json.loads(exc.read() or b"{}")
        except (OSError, ValueError) as exc:
            raise TransportError(f"monitoring endpoint {url} failed: {exc}") from exc

    def route_peers(self, i: int) -> set[str]:
        """The server names node ``i`` holds a route to (a route still in its handshake has none)."""
        return {r.get("remote_name", "") for r in self.monitor(i, "/routez").get("routes") or []} - {""}

    def healthy(self, i: int) -> bool:
        """Node ``i`` is up, knows the meta leader and has caught up on every stream it holds."""
        if not self.running(i):
            return False
        try:
            return bool(self.monitor(i, "/healthz").get("status") == "ok")
        except TransportError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every running node reports healthy: after a start, a restart or a thaw, the cluster
        is whole again only when the returning node has caught up."""
        wanted = self._any_running()
        deadline = time.monotonic() + timeout
        while not all(self.healthy(i) for i in wanted):
            if time.monotonic() > deadline:
                bad = [self.names[i] for i in wanted if not self.healthy(i)]
                raise TransportError(f"nats cluster not healthy within {timeout}s: {', '.join(bad)}")
            time.sleep(0.1)  # polling the monitoring endpoints; they publish no event

    def _any_running(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.running(i)]

    def meta_leader(self) -> str | None:
        """The server name of the JetStream meta leader, as a running node reports it."""
        for i in self._any_running():
            try:
                leader = self.monitor(i, "/jsz").get("meta_cluster", {}).get("leader")
            except TransportError:
                continue
            if leader:
                return str(leader)
        return None

    def stream_leader(self, stream: str) -> str | None:
        """The server name leading ``stream``'s Raft group (None while one is being elected)."""
        for i in self._any_running():
            try:
                jsz = self.monitor(i, "/jsz?accounts=true&streams=true")
            except TransportError:
                continue
            for account in jsz.get("account_details") or ():
                for detail in account.get("stream_detail") or ():
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader:
                            return str(leader)
        return None
