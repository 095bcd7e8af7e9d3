"""Cluster-aware configuration: server lists, replicas (auto, in-place scale-up), clustered nodes.

Pure functions first; then real nats-server processes: a 3-node JetStream cluster on loopback
(:class:`tokenpipe_cli.cluster.LocalCluster`), a single server, and ``tokenpipe up --nats-cluster 3``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats.js.errors
import pytest
from nats.js import api as js_api

from generator.service.publisher import BatchPublisher
from relay.fanout import Fanout
from tokenpipe.append import EXPECTED_LAST, StreamLost, send_live
from tokenpipe.batchstore import BATCH_STREAMS
from tokenpipe.bus import Bus, connect, release_intake
from tokenpipe.cluster import (
    cluster_size,
    parse_replicas,
    replicas_to_keep,
    resolve_replicas,
    server_list,
)
from tokenpipe.errors import ConfigError, TransportError
from tokenpipe.natsconfig import write_server_config
from tokenpipe.retry import through_elections
from tokenpipe.settings import Settings
from tokenpipe.streams import Gap, follow
from tokenpipe.subjects import META_BUCKET, REQUESTS_STREAM, TOKENS_STREAM, consumer_name, intake_stream, token_subject
from tokenpipe.wire import TokenBatch, new_request_id
from tokenpipe_cli.cli import build_parser
from tokenpipe_cli.cluster import LocalCluster
from tokenpipe_cli.clusternode import node_args
from tokenpipe_cli.launch import free_port
from tokenpipe_cli.natsserver import NatsServer

from .conftest import descendants, freeze, read_until_up, wait_until

pytestmark = pytest.mark.timeout(120)

CLUSTER_INFO = {"jetstream": True, "cluster": "c", "connect_urls": ["10.0.0.1:4222", "10.0.0.2:4222", "10.0.0.3:4222"]}


# -- pure ----------------------------------------------------------------------------
def test_server_list_splits_a_seed_list() -> None:
    assert server_list("nats://a:4222") == ["nats://a:4222"]
    assert server_list(" nats://a:4222, nats://b:4222 ,,") == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(ConfigError):
        server_list(" , ")


def test_replicas_setting_is_auto_or_one_to_five() -> None:
    assert parse_replicas("auto") is None and parse_replicas(" AUTO ") is None
    assert parse_replicas("3") == 3
    for bad in ("0", "6", "three", ""):
        with pytest.raises(ConfigError):
            parse_replicas(bad)
    assert Settings.load(env={"TOKENPIPE_REPLICAS": "3"}).replicas == "3"
    assert Settings.load(env={}).replicas == "auto"


def test_auto_replicas_are_three_on_a_cluster_of_three_jetstream_servers() -> None:
    assert resolve_replicas("auto", CLUSTER_INFO) == 3
    assert resolve_replicas("auto", {**CLUSTER_INFO, "connect_urls": CLUSTER_INFO["connect_urls"][:2]}) == 1
    assert resolve_replicas("auto", {**CLUSTER_INFO, "jetstream": False}) == 1
    assert resolve_replicas("auto", {"jetstream": True}) == 1  # a single server
    assert resolve_replicas("1", CLUSTER_INFO) == 1  # explicit wins
    assert cluster_size({**CLUSTER_INFO, "connect_urls": [*CLUSTER_INFO["connect_urls"], "10.0.0.4:4222"]}) == 4


def test_auto_never_scales_an_existing_stream_down_but_an_explicit_setting_does() -> None:
    assert replicas_to_keep(3, 1, "auto") == 3
    assert replicas_to_keep(1, 3, "auto") == 3
    assert replicas_to_keep(3, 1, "1") == 1


def test_clustered_node_needs_a_server_name_and_route_urls() -> None:
    args = node_args("tp", 6222, "nats-route://10.0.0.2:6222, nats-route://10.0.0.3:6222", "n1")
    assert args.routes == ("nats-route://10.0.0.2:6222", "nats-route://10.0.0.3:6222")
    assert args.argv("0.0.0.0") == ["--cluster_name", "tp", "--cluster", "nats://0.0.0.0:6222", "--server_name",
                                    "n1", "--routes", "nats-route://10.0.0.2:6222,nats-route://10.0.0.3:6222"]
    with pytest.raises(ConfigError):
        node_args("tp", 6222, "", None)
    with pytest.raises(ConfigError):
        node_args("tp", 6222, "http://10.0.0.2:6222", "n1")


def test_cli_accepts_the_cluster_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["nats", "--cluster-name", "tp", "--cluster-port", "6223", "--routes",
                              "nats-route://127.0.0.1:6224", "--server-name", "n1", "--port", "4223"])
    assert (args.cluster_name, args.cluster_port, args.server_name) == ("tp", 6223, "n1")
    assert parser.parse_args(["up", "--nats-cluster", "3"]).nats_cluster == 3
    assert parser.parse_args(["up"]).nats_cluster == 1


async def test_through_elections_retries_only_what_means_no_leader_yet() -> None:
    import nats.js.errors

    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise nats.js.errors.NoStreamResponseError
        return "stored"

    assert await through_elections(flaky) == "stored" and len(calls) == 3

    async def refused() -> str:
        calls.append(1)
        raise nats.js.errors.BadRequestError(code=400, description="no")

    calls.clear()
    with pytest.raises(nats.js.errors.BadRequestError):
        await through_elections(refused)
    assert len(calls) == 1

    async def missing() -> str:
        raise nats.js.errors.KeyNotFoundError  # an APIError without a code: a plain "no"

    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await through_elections(missing)


# -- a real 3-node cluster -------------------------------------------------------------
@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("three"), 3) as c:
        yield c


def on(c: LocalCluster, **kw: Any) -> Settings:
    return Settings.load(env={}, nats_url=c.url, **kw)


async def replicas(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).config.num_replicas or 1)


async def test_single_replica_streams_are_scaled_to_three_in_place(three_nodes: LocalCluster) -> None:
    old = await connect(on(three_nodes, replicas="1"), name="test-r1")
    try:
        assert [await replicas(old, s) for s in (REQUESTS_STREAM, TOKENS_STREAM, f"KV_{META_BUCKET}",
                                                 *BATCH_STREAMS)] == [1] * 5
        sid = new_request_id()
        await old.js.publish(token_subject(old.owner, sid), TokenBatch(id=sid, seq=0, index=0, token_ids=(1,)).encode())
        await old.meta.put(sid, b"{}")
    finally:
        await old.close()
    bus = await connect(on(three_nodes), name="test-auto")  # replicas=auto on three JetStream servers
    try:
        # The Batch API's object store and KV bucket too (tokenpipe.batchstore).
        assert [await replicas(bus, s) for s in (REQUESTS_STREAM, TOKENS_STREAM, f"KV_{META_BUCKET}",
                                                 *BATCH_STREAMS)] == [3] * 5
        # The data came along, and the streams work once their new peers caught up.
        assert (await bus.js.get_last_msg(TOKENS_STREAM, token_subject(bus.owner, sid))).data is not None
        assert (await through_elections(lambda: bus.meta.get(sid))).value == b"{}"
        await asyncio.to_thread(three_nodes.wait_healthy, 30)
        again = await connect(on(three_nodes, replicas="auto"), name="test-auto-again")  # idempotent
        await again.close()
    finally:
        await bus.close()


async def test_intake_streams_on_three_replicas_are_sourced_into_the_request_queue(three_nodes: LocalCluster) -> None:
    """The admin's layout with applications (tokenpipe.bus.intake_config), made over an existing
    TP_REQUESTS that took every request itself: it gives up its subjects, the relay's and each app's
    intake stream is made with three replicas, and an app's request reaches TP_REQUESTS' consumers."""
    settings = on(three_nodes, request_max_per_owner=2)
    bus = await connect(settings, name="test-intake", apps=["alice"])
    try:
        held = [REQUESTS_STREAM, intake_stream("alice"), intake_stream("relay")]
        assert [await replicas(bus, s) for s in held] == [3, 3, 3]
        cfg = (await bus.js.stream_info(REQUESTS_STREAM)).config
        assert not cfg.subjects  # every owner's requests come through its intake stream
        assert sorted(s.name for s in cfg.sources or []) == [intake_stream("alice"), intake_stream("relay")]
        relay_cfg = (await bus.js.stream_info(intake_stream("relay"))).config
        assert relay_cfg.subjects == ["tp.req.*.relay", "tp.req.*.relay.*"]  # shared and placed (tokenpipe.placement)
        await bus.js.add_consumer(REQUESTS_STREAM, js_api.ConsumerConfig(
            name="test-intake", durable_name="test-intake", filter_subject="tp.req.m.>",
            ack_policy=js_api.AckPolicy.EXPLICIT))
        pull = await bus.js.pull_subscribe_bind("test-intake", stream=REQUESTS_STREAM)
        for i in range(2):
            ack = await through_elections(lambda i=i: bus.js.publish("tp.req.m.alice", b"r%d" % i))
            assert ack.stream == intake_stream("alice")
        with pytest.raises(nats.js.errors.APIError, match="maximum messages per subject"):
            await bus.js.publish("tp.req.m.alice", b"one too many")  # her bound, refused at her publish
        got: list[Any] = []
        while len(got) < 2:  # sourced into TP_REQUESTS apart: a fetch can return the first before the second is
            got += await pull.fetch(2 - len(got), timeout=10)  # there (a CI run got [r0] alone)
        assert [m.data for m in got] == [b"r0", b"r1"] and {m.subject for m in got} == {"tp.req.m.alice"}
        for m in got:
            await m.ack_sync()
            await release_intake(bus.js, m.subject, m.headers)
        assert (await bus.js.stream_info(intake_stream("alice"))).state.messages == 0  # her places are free
        await bus.js.delete_consumer(REQUESTS_STREAM, "test-intake")
    finally:
        await bus.close()


async def test_regression_an_append_met_by_another_writers_append_in_flight_was_dropped(
        three_nodes: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A clustered stream's leader answers a conditional append with error 10164 ("wrong last sequence",
    no number) while another conditional append to the same subject is being replicated. The publisher
    took that for a refusal for good: it dropped the batch and went on with the next one, as a resumed
    stream's writer whose predecessor still had a batch in flight. It now appends again until the other
    append's outcome decides; here the other writer's batch is stored, so this writer lost the stream."""
    caplog.set_level(logging.INFO, logger="generator.service.publisher")
    c = three_nodes
    setup = await connect(on(c), name="test-in-flight-setup")  # TP_TOKENS on three replicas, and its leader

    found: list[str] = []  # the leader as seen settled: a replica's "current" flickers on a busy machine

    async def settled() -> bool:
        # Asked of the stream itself once every replica is current: right after the scale-up of an earlier
        # test a node's monitoring page can still name the leader before an election.
        try:
            cl = (await setup.js.stream_info(TOKENS_STREAM)).cluster
        except nats.js.errors.Error:
            return False
        current = cl is not None and len(cl.replicas or ()) == 2 and all(r.current for r in cl.replicas or ())
        found[:] = [cl.leader] if cl is not None and current and cl.leader else []
        return bool(found)

    try:
        await wait_until(settled, 30, "TP_TOKENS to have a leader and two current replicas")
    finally:
        await setup.close()
    at = c.names.index(found[0])
    bus = await connect(Settings.load(env={}, nats_url=c.nodes[at].url), name="test-in-flight")
    publisher = BatchPublisher(bus)
    await publisher.start()
    sid = new_request_id()
    subject = token_subject(bus.owner, sid)
    lost: list[StreamLost] = []
    chain = publisher.chain(bus.owner, sid, last=0, on_lost=lost.append)
    followers = [c.nodes[i].child for i in range(3) if i != at]
    try:
        try:
            for child in followers:  # the leader proposes, and nothing is stored while no follower answers
                assert child is not None
                freeze(child.proc.pid)
            other = TokenBatch(id=sid, seq=0, index=0, token_ids=(7, 8))
            await bus.nc.publish(subject, other.encode(), headers={
                "Nats-Msg-Id": f"{bus.owner}:{sid}:0:other", EXPECTED_LAST: "0"})
            await bus.nc.flush()
            ours = TokenBatch(id=sid, seq=0, index=0, token_ids=(7,))
            publisher.publish(chain, ours.encode(), {"Nats-Msg-Id": f"{bus.owner}:{sid}:0:ours"})
            answered = ("another append to the stream is in flight", "batch refused; dropped")
            await wait_until(lambda: any(m in caplog.text for m in answered), 10,
                             "the leader to answer ours while the other one is in flight")
        finally:
            for child in followers:
                assert child is not None
                os.kill(child.proc.pid, signal.SIGCONT)
        assert "batch refused; dropped" not in caplog.text
        await wait_until(lambda: bool(lost), 30, "the writer to lose the stream to the other one")
        assert chain.lost
        stored = await through_elections(lambda: bus.js.get_last_msg(TOKENS_STREAM, subject))
        assert (stored.seq, TokenBatch.decode(stored.data or b"").token_ids) == (lost[0].stored_last, (7, 8))
    finally:
        await publisher.close()
        await bus.close()
        await asyncio.to_thread(c.wait_healthy, 30)


async def test_roles_take_a_server_list_log_their_server_and_reconnect_to_another(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenpipe.bus")
    with LocalCluster(tmp_path, 3) as c:
        dead = f"nats://127.0.0.1:{free_port()}"  # a seed that is down does not stop the others
        bus = await connect(Settings.load(env={}, nats_url=f"{dead},{c.url}"), name="test-list")
        try:
            first = next(r.server for r in caplog.records if r.getMessage() == "nats connected")  # type: ignore[attr-defined]
            node = next(i for i, n in enumerate(c.nodes) if n.url.endswith(first))
            c.kill(node)
            await _until(lambda: bus.nc.is_connected and not c.nodes[node].url.endswith(
                f"{bus.nc.connected_url.hostname}:{bus.nc.connected_url.port}"))
            await _until(lambda: any(r.getMessage() == "nats reconnected" for r in caplog.records))
            again = next(r.server for r in caplog.records if r.getMessage() == "nats reconnected")  # type: ignore[attr-defined]
            assert again != first
        finally:
            await bus.close()


async def _until(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_three_replicas_on_a_single_server_fail_with_what_to_do(tmp_path: Path) -> None:
    with NatsServer(tmp_path) as server:
        bus = await connect(Settings.load(env={}, nats_url=server.url), name="test-r1")  # auto: 1 here
        await bus.close()
        with pytest.raises(TransportError, match=r"from 1 to 3 replicas.*TOKENPIPE_REPLICAS"):
            await connect(Settings.load(env={}, nats_url=server.url, replicas="3"), name="test-r3")


async def test_local_cluster_nodes_get_the_single_servers_authorization_and_route_users(tmp_path: Path) -> None:
    conf = write_server_config(tmp_path / "nats-server.conf", tmp_path / "creds")
    with LocalCluster(tmp_path / "cluster", 3, config_file=conf) as c:
        node_conf = (tmp_path / "cluster" / c.names[0] / "nats-server.conf").read_text()
        assert 'include "../../nats-server.conf"' in node_conf and "authorization { user: \"route\"" in node_conf
        assert "nats-route://route:" in node_conf  # the other nodes are dialled with the route user
        # The admin provisions (the relay may only look), across the cluster the routes formed.
        bus = await connect(on(c, nats_creds=str(tmp_path / "creds" / "admin.json")), name="test-admin", role="admin")
        try:
            assert await replicas(bus, TOKENS_STREAM) == 3  # the routes formed one cluster
        finally:
            await bus.close()


async def test_tokenpipe_nats_runs_the_nodes_of_a_cluster(tmp_path: Path) -> None:
    ports, routes = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    procs = []
    try:
        for i in range(3):
            others = ",".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenpipe_cli", "nats", "--port", str(ports[i]),
                 "--data-dir", str(tmp_path / str(i)), "--cluster-name", "tp", "--cluster-port", str(routes[i]),
                 "--routes", others, "--server-name", f"n{i}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        url = ",".join(f"nats://127.0.0.1:{p}" for p in ports)
        deadline = time.monotonic() + 60
        while True:  # the nodes start, find each other and elect a meta leader
            try:
                bus = await connect(Settings.load(env={}, nats_url=url), name="test-cli-nodes")
            except TransportError:
                assert time.monotonic() < deadline, "the cluster never formed"
                await asyncio.sleep(0.5)
                continue
            # JetStream answers once two of three nodes elected a leader; `auto` counts the routes
            # the connected node advertises, so on a busy machine the third could still be joining
            # (replicas 1). Connect again until every node is in the cluster.
            if cluster_size(bus.nc._server_info) >= 3:
                break
            await bus.close()
            assert time.monotonic() < deadline, "the third node never joined"
            await asyncio.sleep(0.5)
        try:
            assert await replicas(bus, TOKENS_STREAM) == 3  # auto: three JetStream servers
        finally:
            await bus.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


# -- readers of streams whose first batches are stored late (found on the cluster) --------
async def store(bus: Bus, sid: str, seqs: list[int], final: int) -> None:
    for seq in seqs:
        batch = TokenBatch(id=sid, seq=seq, index=seq, token_ids=(100 + seq,),
                           finish="length" if seq == final else None, timings={"emitted": time.time_ns()})
        data = batch.encode()
        await bus.js.publish(token_subject(bus.owner, sid), data)
        await send_live(bus, bus.owner, sid, data, {})  # as a writer does, once stored


async def test_regression_first_batches_stored_late_were_reported_expired(bus: Bus) -> None:
    """After a TP_TOKENS leader change the first batches of a new stream were republished and
    stored after later ones; a reader that looked in between yielded a "retention" gap at once.
    Young batches now mean "not stored yet": both readers wait for them."""
    for reader in ("fanout", "follow"):
        sid = new_request_id()
        await store(bus, sid, [2, 3], final=4)
        fanout = Fanout(bus)
        await fanout.start()
        try:
            source = fanout.open(sid).items() if reader == "fanout" else follow(bus, sid)
            got: list[Any] = []

            async def read(src: Any = source, out: list[Any] = got) -> None:
                async for item in src:
                    out.append(item)

            task = asyncio.create_task(read())
            await asyncio.sleep(0.3)  # the reader has looked and found only 2 and 3
            await store(bus, sid, [0, 1, 4], final=4)
            await asyncio.wait_for(task, 10)
        finally:
            await fanout.stop()
        assert not [g for g in got if isinstance(g, Gap)], reader
        assert [b.seq for b in got] == [0, 1, 2, 3, 4], reader


class _DropLive(Fanout):
    """Loses seq 0 of every stream on the live path, as a reconnect would."""

    async def _on_msg(self, msg: Any) -> None:
        if TokenBatch.decode(msg.data).seq != 0:
            await super()._on_msg(msg)


async def test_regression_a_hole_was_looked_up_again_only_when_traffic_stopped(bus: Bus) -> None:
    """A reader whose first look at a hole came too early did not look again while live batches
    kept arriving (each postponed the next look by 30 s): the missing batch, stored a moment
    later, reached the client only at the 15 s reorder deadline."""
    sid = new_request_id()
    fanout = _DropLive(bus, reorder_wait=15.0)
    await fanout.start()
    try:
        live = fanout.open(sid)
        got: list[Any] = []

        async def read() -> None:
            async for item in live.items():
                got.append(item)

        task = asyncio.create_task(read())
        t0 = time.monotonic()
        await store(bus, sid, [1], final=30)  # arrives live: a hole at 0, looked up at once, not there
        await asyncio.sleep(0.2)
        await store(bus, sid, [0], final=30)  # stored now, but lost on the live path
        for seq in range(2, 31):
            await asyncio.sleep(0.1)  # a generation's pace
            await store(bus, sid, [seq], final=30)
        await asyncio.wait_for(task, 20)
        waited = time.monotonic() - t0
    finally:
        await fanout.stop()
    assert [b.seq for b in got] == list(range(31))
    assert waited < 10, f"batch 0 waited for the reorder deadline ({waited:.1f} s)"


# -- tokenpipe up --nats-cluster 3 -------------------------------------------------------
@pytest.fixture
async def up_cluster(tmp_path: Path, data_dir: Path) -> AsyncIterator[tuple[subprocess.Popen[str], str, str, str]]:
    port = free_port()
    (tmp_path / "models").symlink_to(data_dir / "models", target_is_directory=True)
    env = {**os.environ, "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.5", "TOKENPIPE_METRICS_PORT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenpipe_cli", "up", "--nats-cluster", "3",
                             "--model", "tiny-random", "--port", str(port), "--nats-port", str(free_port()),
                             "--data-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        nats_url = re.search(r"\(NATS (\S+?)[,;] ", read_until_up(proc))
        assert nats_url is not None
        yield proc, f"http://127.0.0.1:{port}", nats_url.group(1), str(tmp_path / "creds" / "admin.json")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
async def test_up_with_a_local_three_node_cluster(up_cluster: tuple[subprocess.Popen[str], str, str, str]) -> None:
    proc, url, nats_url, creds = up_cluster
    assert len(server_list(nats_url)) == 3
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in descendants(proc.pid)]
    assert names.count("nats-server") == 3
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        sid = (await http.post("/v1/streams", json={"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True})).json()["id"]
        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            assert "event: done" in (await resp.aread()).decode()
    # Every node runs the single server's authorization: the admin's credentials from the data dir.
    bus = await connect(Settings.load(env={}, nats_url=nats_url, nats_creds=creds), name="test-up",
                        provision_streams=False, role="admin")
    try:
        assert await replicas(bus, TOKENS_STREAM) == 3 and await replicas(bus, REQUESTS_STREAM) == 3
        # One short ack_wait on a cluster too: the store, not a timeout, keeps a stream to one writer.
        consumer = await bus.js.consumer_info(REQUESTS_STREAM, consumer_name("tiny-random"))
        assert consumer.config.ack_wait == Settings.load(env={}).ack_wait_s
    finally:
        await bus.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


# -- the cluster benchmarks run end to end (tiny loads) -------------------------------------
def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=200,
                          cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(240)
def test_relay_and_replication_benchmarks_run(tmp_path: Path) -> None:
    relays = _bench("bench.relays", "--streams", "20", "--rate", "200", "--batches", "4", "--relays", "1,2",
                    "--out", str(tmp_path / "relays.json"))
    assert relays.returncode == 0, relays.stdout[-2000:] + relays.stderr[-2000:]
    runs = json.loads((tmp_path / "relays.json").read_text())["runs"]
    assert [r["relays"] for r in runs] == [1, 2]
    assert all(r["batches_delivered"] == 80 for r in runs)
    repl = _bench("bench.replication", "--rate", "200", "--seconds", "1", "--rounds", "1", "--tokens", "1",
                  "--out", str(tmp_path / "replication.json"))
    assert repl.returncode == 0, repl.stdout[-2000:] + repl.stderr[-2000:]
    runs = json.loads((tmp_path / "replication.json").read_text())["runs"]
    assert [r["replicas"] for r in runs] == [1, 3] and all(r["stored"] == 200 for r in runs)
