"""tokenpipe on a NATS cluster: the server list, the replica count, and a local N-node cluster.

The distributed engine is NATS itself: a JetStream cluster (Raft, R3 streams and KV) is the
unit of durability, and every role takes a server list and reconnects across its nodes. This
module is the one place that knows about clusters:

- :func:`server_list` reads ``TOKENPIPE_NATS_URL`` (one URL, or a comma-separated seed list);
- :func:`resolve_replicas` turns ``TOKENPIPE_REPLICAS`` (``auto`` or 1..5) into the replica
  count the streams and the KV bucket are provisioned with: ``auto`` is 3 when the connected
  server belongs to a cluster of at least three JetStream servers, else 1;
- :class:`LocalCluster` runs N nats-server processes on loopback, each with its own store
  (``tokenpipe up --nats-cluster 3``, the fault tests, ``bench.replication``), and inspects
  them through their monitoring endpoints (meta leader, stream leaders, health).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from .errors import InvalidRequest, TransportError
from .natsserver import ClusterArgs, NatsServer, free_port

__all__ = ["ELECTION_WINDOW_S", "LocalCluster", "cluster_size", "connected_server", "node_args", "parse_replicas",
           "replicas_to_keep", "resolve_replicas", "server_list", "through_elections"]

log = logging.getLogger(__name__)

MAX_REPLICAS = 5  # JetStream's own limit on a stream's replicas
# How long a JetStream call is retried while its stream has no leader: nats-server's Raft
# elects a new one 4-9 s after the old leader vanished (measured here: 4.5-5.5 s), and a
# client whose server died needs a moment to reconnect to another.
ELECTION_WINDOW_S = 15.0
_ATTEMPT_TIMEOUT_S = 2.0  # per try: an answer from a live leader takes milliseconds

T = TypeVar("T")


def server_list(nats_url: str) -> list[str]:
    """``TOKENPIPE_NATS_URL`` as a list: one server, or a cluster's seed list ``url,url,url``.
    A client needs only one reachable seed: the servers tell it about the rest of the cluster."""
    servers = [u.strip() for u in nats_url.split(",") if u.strip()]
    if not servers:
        raise InvalidRequest("TOKENPIPE_NATS_URL names no server", param="nats_url")
    return servers


def connected_server(nc: Any) -> str:
    """``host:port`` of the server a client is on now (never the credentials a URL may carry)."""
    url = nc.connected_url
    return f"{url.hostname}:{url.port}" if url is not None else "none"


def parse_replicas(value: str) -> int | None:
    """``auto`` → None (decided by :func:`resolve_replicas`), else an int in 1..5."""
    text = value.strip().lower()
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_REPLICAS:
        raise InvalidRequest(f"TOKENPIPE_REPLICAS must be 'auto' or 1..{MAX_REPLICAS}, not {value!r}",
                             param="replicas")
    return n


def cluster_size(server_info: dict[str, Any]) -> int:
    """How many JetStream servers the connected server's cluster has, from its INFO: 1 unless
    it runs JetStream in a named cluster, else the client URLs it advertises (itself included;
    a server advertises its cluster's servers to clients unless ``no_advertise`` is set)."""
    if not server_info.get("jetstream") or not server_info.get("cluster"):
        return 1
    urls = {u for u in server_info.get("connect_urls") or () if u}
    return max(1, len(urls))


def resolve_replicas(setting: str, server_info: dict[str, Any]) -> int:
    """The replica count for streams and KV: the explicit setting, or (``auto``) 3 on a cluster
    of three or more JetStream servers, else 1."""
    explicit = parse_replicas(setting)
    if explicit is not None:
        return explicit
    return 3 if cluster_size(server_info) >= 3 else 1


def node_args(cluster_name: str, cluster_port: int, routes: str, server_name: str | None) -> ClusterArgs:
    """``tokenpipe nats --cluster-name N --cluster-port P --routes URL,URL --server-name S``:
    JetStream clustering needs both names; every node lists the others' ``nats-route://`` URLs."""
    if not server_name:
        raise InvalidRequest("a clustered node needs --server-name (unique in the cluster)", param="server_name")
    urls = tuple(u.strip() for u in routes.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("nats-route://", "nats://")):
            raise InvalidRequest(f"route {url!r} is not a nats-route://host:port URL", param="routes")
    return ClusterArgs(name=cluster_name, port=cluster_port, server_name=server_name, routes=urls)


def replicas_to_keep(have: int, wanted: int, setting: str) -> int:
    """The replica count an existing stream should get: ``wanted``, except that ``auto`` never
    scales down (a client that saw only part of the cluster at start-up must not shrink it)."""
    if parse_replicas(setting) is None:
        return max(have, wanted)
    return wanted


def _transient(exc: BaseException) -> bool:
    """Errors that mean "no leader right now" rather than "no": nobody answered (the stream's
    leader is being elected; the stream's subjects have no responder), the answer timed out (the
    request went to a server that died), or JetStream said it is temporarily unavailable."""
    if isinstance(exc, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError
                  | nats.errors.TimeoutError | asyncio.TimeoutError | nats.errors.ConnectionReconnectingError
                  | nats.js.errors.ServiceUnavailableError):
        return True
    if not isinstance(exc, nats.js.errors.APIError):
        return False
    # 409 "duplicate message id is in process": the previous try is still being replicated.
    # (Some subclasses, KeyNotFoundError among them, never set code or description.)
    code, description = getattr(exc, "code", None), getattr(exc, "description", None) or ""
    return code == 503 or (code == 409 and "in process" in description)


async def through_elections(op: Callable[[], Awaitable[T]], *, window_s: float = ELECTION_WINDOW_S) -> T:
    """Run a JetStream call, trying again while the stream it needs is between leaders.

    Only for idempotent calls (a publish with ``Nats-Msg-Id``, a KV put of the same value, a
    get). Each try gets :data:`_ATTEMPT_TIMEOUT_S`; the last error is raised after ``window_s``.
    On a single server this costs nothing: the first try answers.
    """
    deadline = time.monotonic() + window_s
    delay = 0.05
    while True:
        try:
            return await asyncio.wait_for(op(), timeout=_ATTEMPT_TIMEOUT_S)
        except Exception as exc:
            if not _transient(exc) or time.monotonic() + delay >= deadline:
                raise
            log.info("jetstream unavailable; retrying", extra={"error": repr(exc)})
        await asyncio.sleep(delay)  # backing off while a leader is elected; nothing to wait on
        delay = min(delay * 2, 1.0)


class LocalCluster:
    """N nats-server processes on loopback forming one JetStream cluster, each with its own store
    under ``data_dir/<server name>`` and a monitoring port; start/stop as a whole or node by node."""

    def __init__(self, data_dir: str | os.PathLike[str], size: int = 3, *, host: str = "127.0.0.1",
                 name: str = "tokenpipe", first_port: int | None = None) -> None:
        if size < 1:
            raise InvalidRequest("a cluster needs at least one node", param="nats_cluster")
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        ports = [first_port or free_port(host)] + [free_port(host) for _ in range(size - 1)]
        route_ports = [free_port(host) for _ in range(size)]
        self.nodes: list[NatsServer] = []
        for i in range(size):
            routes = tuple(f"nats-route://{host}:{p}" for j, p in enumerate(route_ports) if j != i)
            args = ClusterArgs(name=name, port=route_ports[i], server_name=f"{name}-{i}", routes=routes)
            self.nodes.append(NatsServer(self.data_dir / args.server_name, host=host, port=ports[i],
                                         monitor_port=free_port(host), cluster=args))

    @property
    def url(self) -> str:
        """The seed list to give every role (``TOKENPIPE_NATS_URL``)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def names(self) -> list[str]:
        return [self.server_name(i) for i in range(len(self.nodes))]

    def server_name(self, i: int) -> str:
        cluster = self.nodes[i].cluster
        assert cluster is not None
        return cluster.server_name

    def index(self, server_name: str) -> int:
        return self.names.index(server_name)

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
        proc, node.proc = node.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def restart(self, i: int, *, graceful: bool = True, timeout: float = 30.0) -> None:
        """Stop node ``i`` (SIGTERM, or SIGKILL with ``graceful=False``) and start it again on the
        same ports and store; returns once it listens (see :meth:`wait_healthy` for caught up)."""
        if graceful:
            self.thaw(i)
            self.nodes[i].stop()
        else:
            self.kill(i)
        self.nodes[i].start(timeout)

    def start_node(self, i: int, timeout: float = 30.0) -> None:
        self.nodes[i].start(timeout)

    def freeze(self, i: int) -> None:
        """SIGSTOP node ``i``: its sockets stay open but nothing answers (a hung host)."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    def running(self, i: int) -> bool:
        proc = self.nodes[i].proc
        return proc is not None and proc.poll() is None

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

    def healthy(self, i: int) -> bool:
        """Node ``i`` is up, knows the meta leader and has caught up on every stream it holds."""
        if not self.running(i):
            return False
        try:
            return bool(self.monitor(i, "/healthz").get("status") == "ok")
        except TransportError:
            return False

    def wait_healthy(self, timeout: float = 30.0, nodes: list[int] | None = None) -> None:
        """Until every running node (or those given) reports healthy: after a start, a restart or a
        thaw, the cluster is whole again only when the returning node has caught up."""
        wanted = [i for i in (nodes if nodes is not None else range(len(self.nodes))) if self.running(i)]
        deadline = time.monotonic() + timeout
        while not all(self.healthy(i) for i in wanted):
            if time.monotonic() > deadline:
                bad = [self.server_name(i) for i in wanted if not self.healthy(i)]
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
