"""NATS node failures under load on a real 3-node JetStream cluster (R3 streams).

Each test keeps 16 streams in flight over two relays, served by two generators, while it
breaks the cluster: ``kill -9`` of the meta leader and of the leaders of TP_TOKENS and
TP_REQUESTS, a rolling restart of all three nodes, a node frozen with SIGSTOP for 10 s and one
frozen until the streams in flight end without it, and requests submitted while their stream's
leader is being elected. Every stream must be served
and end with ``done``, contiguous, with no batch twice and the tokens of an undisturbed greedy
run; each test prints what the fault cost (``pytest -s`` shows it). The cluster and the roles
are shared by the tests of this module and made whole again before each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from generator.model.loader import LoadedModel
from tokenpipe.settings import Settings
from tokenpipe.subjects import REQUESTS_STREAM, TOKENS_STREAM, consumer_name

from .clusterkit import STREAMS, Load, Outcome, Report, Stack, greedy_reference, verify
from .conftest import wait_until

pytestmark = pytest.mark.timeout(240)

# The goal for a client's longest stall when a leader is killed: usually met (the
# stall is then the time a relay or generator takes to reconnect). Not guaranteed: a batch
# lost with the dying node (in its socket buffers, or while subscription interest moves between
# the survivors) is read back from JetStream, and that read needs the stream's leader (it
# counts) and the meta leader (it places the reading consumer): once they are elected
# (nats-server's Raft: 4-9 s after a kill -9). A look that fails is retried 0.5-1.5 s later and
# each try waits up to 5 s for an answer, so the tests assert that bound — every leader elected,
# then one failed look and a retry — and print the stall against the goal (docs/perf-history.md
# has how often it was missed). What the bound catches is a stream that does not come back at all.
LEADER_KILL_STALL_GOAL_S = 3.0
RETRIED_LOOK_S = 5.0 + 1.5 + 3.0  # a try's timeout, the retry delay, margin for a busy 2-core machine


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("cluster"), data_dir)
    try:
        yield await s.start()
    finally:
        await s.close()


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> list[list[int]]:
    return greedy_reference(tiny_model)


@pytest.fixture
async def cluster(stack: Stack) -> AsyncIterator[Stack]:
    await stack.restore()
    yield stack
    assert stack.roles_alive(), "a generator or relay process died"


async def under_load(stack: Stack, reference: list[list[int]], scenario: str,
                     fault: Callable[[Load], Awaitable[None]]) -> Report:
    """Streams flowing before the fault, through it, and after it; then every one verified."""
    load = Load(stack.relay_urls).start()
    try:
        await load.wait_streams(4)
        await fault(load)
        await load.wait_streams(8)  # and the cluster serves new streams afterwards
    finally:
        outcomes = await load.stop()
    report = verify(scenario, outcomes, reference, await stack.stored_when_settled(outcomes))
    print("\n" + report.line())
    if not report.clean:
        raise AssertionError(f"{report.problems[:10]}\n{await stack.explain(outcomes, report.problems)}")
    return report


@dataclass
class Kill:
    node: int = -1
    elected_s: float = 0.0  # until the killed leader's role had a new leader
    healed_s: float = 0.0  # until the meta leader and every stream had one
    roles: dict[str, int] = field(default_factory=dict)

    def stall_bound(self) -> float:
        """Every leader elected, then a failed look and its retry (see :data:`LEADER_KILL_STALL_GOAL_S`)."""
        return self.healed_s + RETRIED_LOOK_S


async def kill_leader(stack: Stack, leader_of: Callable[[], str | None], kill: Kill) -> None:
    """``kill -9`` the node that ``leader_of()`` names; back once another node leads; the killed
    node is started again (it rejoins and catches up)."""
    c = stack.cluster
    leader = leader_of()
    assert leader is not None
    kill.node = c.names.index(leader)
    kill.roles = stack.roles_on(kill.node)
    t0 = time.monotonic()
    c.kill(kill.node)
    await wait_until(lambda: leader_of() not in (None, leader), 30, "a new leader")
    kill.elected_s = time.monotonic() - t0
    await wait_until(lambda: c.meta_leader() is not None and all(c.stream_leader(s) for s in STREAMS), 30,
                     "every leader")
    kill.healed_s = time.monotonic() - t0
    await asyncio.to_thread(c.start_node, kill.node)


async def leader_kill(stack: Stack, reference: list[list[int]], what: str,
                      leader_of: Callable[[], str | None]) -> None:
    kill = Kill()
    report = await under_load(stack, reference, f"kill -9 {what}",
                              lambda load: kill_leader(stack, leader_of, kill))
    goal = "met" if report.max_stall_s <= LEADER_KILL_STALL_GOAL_S else "missed"
    print(f"{what} re-elected in {kill.elected_s:.1f} s (every leader: {kill.healed_s:.1f} s); the killed node "
          f"served {kill.roles}; "
          f"longest stall {report.max_stall_s:.2f} s: the {LEADER_KILL_STALL_GOAL_S:g} s goal {goal}")
    assert report.max_stall_s <= kill.stall_bound(), report.line()


async def test_the_cluster_runs_the_single_server_ack_wait(cluster: Stack) -> None:
    """Regression: with a 4 s ack_wait a TP_TOKENS leader kill stopped a generator's progress acks
    long enough for its request to be redelivered to the other generator; both wrote it, and the
    client got the two streams mixed ("batch 2 at index 3"). The fix then was a 30 s cluster
    ack_wait; now the store takes one writer's appends only (tokenpipe.append), so the cluster runs
    the same short ack_wait, and the leader-kill tests below check every client against the
    reference generation under it."""
    assert cluster.bus is not None
    info = await cluster.bus.js.consumer_info(REQUESTS_STREAM, consumer_name("tiny-random"))
    assert cluster.bus.replicas == 3
    assert info.config.ack_wait == Settings.load(env={}).ack_wait_s


async def test_kill9_of_the_meta_leader(cluster: Stack, reference: list[list[int]]) -> None:
    await leader_kill(cluster, reference, "meta leader", cluster.cluster.meta_leader)


async def test_kill9_of_the_token_stream_leader(cluster: Stack, reference: list[list[int]]) -> None:
    await leader_kill(cluster, reference, f"{TOKENS_STREAM} leader",
                      lambda: cluster.cluster.stream_leader(TOKENS_STREAM))


async def test_kill9_of_the_request_stream_leader(cluster: Stack, reference: list[list[int]]) -> None:
    await leader_kill(cluster, reference, f"{REQUESTS_STREAM} leader",
                      lambda: cluster.cluster.stream_leader(REQUESTS_STREAM))


async def test_request_submitted_while_its_stream_leader_is_elected(cluster: Stack,
                                                                   reference: list[list[int]]) -> None:
    c = cluster.cluster
    submitted: list[float] = []

    async def fault(load: Load) -> None:
        leader = c.stream_leader(REQUESTS_STREAM)
        assert leader is not None
        c.kill(c.names.index(leader))
        # At once, before the survivors have even noticed: nobody leads TP_REQUESTS now.
        outs = await asyncio.gather(*(load.submit(i % 2, i) for i in range(4)))
        submitted.extend(o.post_s for o in outs)
        assert c.stream_leader(REQUESTS_STREAM) not in (None, leader), "submitted, yet no new leader?"
        await asyncio.to_thread(c.start_node, c.names.index(leader))

    await under_load(cluster, reference, "submit during TP_REQUESTS election", fault)
    print(f"submissions during the election took {', '.join(f'{s:.1f}' for s in submitted)} s")
    assert min(submitted) > 0.5  # they really waited for the election (which takes seconds)


async def test_rolling_restart_of_all_three_nodes(cluster: Stack, reference: list[list[int]]) -> None:
    async def fault(load: Load) -> None:
        for node in range(3):
            await asyncio.to_thread(cluster.cluster.restart, node)
            await cluster.restore()  # caught up before the next one goes
            await load.wait_streams(2)

    await under_load(cluster, reference, "rolling restart", fault)


def busiest_node(stack: Stack) -> int:
    """The node most roles are connected to: freezing it makes their clients wait for the stale-connection check."""
    roles = [sum(stack.roles_on(i).values()) for i in range(3)]
    return roles.index(max(roles))


async def test_node_frozen_for_ten_seconds(cluster: Stack, reference: list[list[int]]) -> None:
    c = cluster.cluster

    async def fault(load: Load) -> None:
        node = busiest_node(cluster)
        print(f"\nfreezing {c.names[node]}, serving {cluster.roles_on(node)}")
        c.freeze(node)
        try:
            await asyncio.sleep(10)  # the fault itself: a host that hangs for 10 s
        finally:
            c.thaw(node)

    await under_load(cluster, reference, "SIGSTOP 10 s", fault)


ROUTE_DROPPED_BOUND_S = 20.0  # three route pings a second apart (measured ~3 s); nats-server's default: minutes
# What a stream in flight may wait for while the node stays frozen, each wait bounded: its
# clients' connections to the node declared dead (a ping every 2 s, 3 missed: ~8 s), the routes
# dropped (~3 s) and a Raft election for what the node led (4-9 s), a reader's look that timed out
# meanwhile (5 s) and its retry (1.5 s): ~27 s; measured 13-17 s here, and past 30 s once on a
# slower CI machine. A stream held until the thaw (the bug pinned) never ends within any bound.
FROZEN_NODE_BOUND_S = 45.0


async def test_a_frozen_node_loses_its_routes_in_seconds_and_holds_no_stream_until_it_thaws(
        cluster: Stack, reference: list[list[int]]) -> None:
    """Regression: with nats-server's default route pings (every 2 minutes) the other nodes kept
    their routes to a frozen node, and a JetStream request that went through it waited for the
    thaw: a stream stalled as long as the node was frozen (21 s in a 20 s freeze; 22 s for the
    streams in flight here). With route pings every second, three unanswered dropping the route
    (tokenpipe_cli.cluster), the survivors drop it within seconds and the streams in flight end
    while the node is still frozen (13 s here)."""
    c = cluster.cluster
    took: list[float] = []

    def ended(o: Outcome) -> bool:
        return bool(o.error) or o.finished

    async def fault(load: Load) -> None:
        node = busiest_node(cluster)
        name, others = c.names[node], [i for i in range(3) if i != node]
        assert all(name in c.route_peers(i) for i in others)
        in_flight = [o for o in load.outcomes if not ended(o)]
        t0 = time.monotonic()
        c.freeze(node)
        try:
            await wait_until(lambda: all(name not in c.route_peers(i) for i in others), ROUTE_DROPPED_BOUND_S,
                             f"the other nodes to drop their routes to the frozen {name}")
            took.append(time.monotonic() - t0)
            await wait_until(lambda: all(ended(o) for o in in_flight), FROZEN_NODE_BOUND_S,
                             f"the {len(in_flight)} streams in flight at the freeze of {name} to end, it still frozen")
            took.append(time.monotonic() - t0)
        finally:
            c.thaw(node)

    await under_load(cluster, reference, "SIGSTOP until the streams in flight end", fault)
    print(f"routes to the frozen node dropped after {took[0]:.1f} s; the streams in flight at the freeze ended "
          f"{took[1]:.1f} s after it, the node still frozen")
