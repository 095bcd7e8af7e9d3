"""One nats-server as a node of a JetStream cluster: its cluster flags (``tokenpipe nats --cluster-name
...``, :func:`node_args`) and its ``cluster`` configuration block, routes authenticated with a route user
of their own (:meth:`ClusterArgs.config_block`). :mod:`tokenpipe_cli.natsserver` starts such a node;
:mod:`tokenpipe_cli.cluster` runs several on loopback."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenpipe.errors import ConfigError

__all__ = ["ClusterArgs", "node_args"]


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
