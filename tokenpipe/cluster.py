"""tokenpipe on a NATS cluster: the server list and the replica count.

The distributed engine is NATS itself: a JetStream cluster (Raft, R3 streams and KV) is the
unit of durability, and every role takes a server list and reconnects across its nodes. The
request consumer's ``ack_wait`` is the same on one node and a cluster: who writes a stream is
decided by the store (:mod:`tokenpipe.append`), never by a timeout. Retrying through leader
elections is :mod:`tokenpipe.retry`'s; running clustered nats-server processes,
:mod:`tokenpipe_cli.cluster`'s.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["MAX_REPLICAS", "cluster_size", "connected_server", "parse_replicas",
           "replicas_to_keep", "resolve_replicas", "server_list"]

MAX_REPLICAS = 5  # JetStream's own limit on a stream's replicas


def server_list(nats_url: str) -> list[str]:
    """``TOKENPIPE_NATS_URL`` as a list: one server, or a cluster's seed list ``url,url,url``.
    A client needs only one reachable seed: the servers tell it about the rest of the cluster."""
    servers = [u.strip() for u in nats_url.split(",") if u.strip()]
    if not servers:
        raise ConfigError("TOKENPIPE_NATS_URL names no server", param="nats_url")
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
        raise ConfigError(f"TOKENPIPE_REPLICAS must be 'auto' or 1..{MAX_REPLICAS}, not {value!r}",
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


def replicas_to_keep(have: int, wanted: int, setting: str) -> int:
    """The replica count an existing stream should get: ``wanted``, except that ``auto`` never
    scales down (a client that saw only part of the cluster at start-up must not shrink it)."""
    if parse_replicas(setting) is None:
        return max(have, wanted)
    return wanted
