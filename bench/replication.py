"""What replication costs: token batches into an R1 and an R3 stream on a local 3-node cluster.

    python -m bench.replication        # 4,000 batches/s, 8 s a run: R1/R3 × 1- and 8-token batches, twice (~3 min)
    python -m bench.replication --rate 8000 --seconds 10 --rounds 3

Three nats-server processes on loopback (``tokenpipe.cluster.LocalCluster``), two file-storage
streams configured like ``TP_TOKENS`` (limits, 2 min dedup window, direct gets) but with one
and three replicas. A publisher sends token batches as the generator does (``publish_async``
with a ``Nats-Msg-Id`` and trace headers, each PubAck checked) at a fixed rate, and a sample of
awaited publishes times the PubAck. Measured per run, over all three servers: CPU per batch,
bytes on the routes between servers per batch (``/routez``), bytes stored per batch on disk
(every replica), and the PubAck round trip. These are the unit costs of ``docs/scaling.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.js import api as js_api
from rich.console import Console
from rich.table import Table

from tokenpipe import eventloop
from tokenpipe.cluster import server_list
from tokenpipe.wire import TokenBatch, new_request_id
from tokenpipe_cli.cluster import LocalCluster
from tokenpipe_cli.stats import latency_stats

from .common import cpu_seconds, write_json

__all__ = ["main", "measure"]

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _batch(sid: str, seq: int, tokens: int) -> bytes:
    """A coalesced batch of ``tokens`` tokens (about 4.5 characters of text each), as published."""
    return TokenBatch(id=sid, seq=seq, index=tokens * seq, token_ids=tuple(range(1000, 1000 + tokens)),
                      text=" word" * tokens, timings={"emitted": time.time_ns()}).encode()


def _route_bytes(cluster: LocalCluster) -> int:
    total = 0
    for i in range(len(cluster.nodes)):
        for route in cluster.monitor(i, "/routez").get("routes") or ():
            total += int(route.get("out_bytes", 0))
    return total


def _disk_bytes(cluster: LocalCluster, stream: str) -> int:
    """Bytes of ``stream``'s message blocks on every node's disk (every replica counted)."""
    total = 0
    for node in cluster.nodes:
        for path in node.data_dir.rglob(f"streams/{stream}/msgs/*.blk"):
            total += path.stat().st_size
    return total


async def _add_stream(js: Any, config: js_api.StreamConfig, within: float = 60.0) -> None:
    """Create ``config``'s stream, asking again while the API times out: a cluster that has just formed
    on a busy machine can take longer than one API timeout to place a stream (the same config again
    is idempotent)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await js.add_stream(config)
            return
        except nats.errors.TimeoutError:
            if time.monotonic() > deadline:
                raise


async def measure(cluster: LocalCluster, replicas: int, rate: float, seconds: float, streams: int,
                  tokens: int = 8) -> dict[str, Any]:
    """Publish ``rate`` batches/s for ``seconds`` into a fresh stream with ``replicas`` replicas."""
    name = f"BENCH_R{replicas}_{new_request_id()[:6].replace('-', 'x').replace('_', 'y')}"
    nc = await nats.connect(servers=server_list(cluster.url), name="bench-replication")
    js = nc.jetstream(timeout=10)
    try:
        await _add_stream(js, js_api.StreamConfig(
            name=name, subjects=[f"{name.lower()}.>"], retention=js_api.RetentionPolicy.LIMITS,
            storage=js_api.StorageType.FILE, max_age=3600, duplicate_window=120, allow_direct=True,
            num_replicas=replicas))
        await asyncio.to_thread(cluster.wait_healthy, 30)
        ids = [new_request_id() for _ in range(streams)]
        pids = [n.pid for n in cluster.nodes if n.pid is not None]
        leader = cluster.names.index(cluster.stream_leader(name) or cluster.names[0])
        per0, routes0 = [cpu_seconds(p) for p in pids], _route_bytes(cluster)
        acks: list[asyncio.Future[Any]] = []
        round_trips: list[float] = []
        total = int(rate * seconds)
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            due = min(total, int((time.perf_counter() - t0) * rate) + 1)
            while sent < due:
                seq, i = divmod(sent, streams)
                subject, headers = f"{name.lower()}.{ids[i]}", {"Nats-Msg-Id": f"{ids[i]}:{seq}",
                                                                 "traceparent": TRACEPARENT}
                if sent % 200 == 0:  # a sample timed end to end, awaited as a submit would be
                    t = time.perf_counter()
                    await js.publish(subject, _batch(ids[i], seq, tokens), headers=headers)
                    round_trips.append(time.perf_counter() - t)
                else:
                    acks.append(await js.publish_async(subject, _batch(ids[i], seq, tokens), headers=headers))
                sent += 1
            await asyncio.sleep(0.001)  # pacing
        results = await asyncio.gather(*acks, return_exceptions=True)
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # followers apply the tail; the route counters settle
        per1, routes1 = [cpu_seconds(p) for p in pids], _route_bytes(cluster)
        info = await js.stream_info(name)
        disk = _disk_bytes(cluster, name)
        on_leader = nc.connected_url is not None and cluster.nodes[leader].port == nc.connected_url.port
        await js.delete_stream(name)
    finally:
        await nc.close()
    failed = sum(1 for r in results if isinstance(r, BaseException))
    n = info.state.messages
    cpu0, cpu1 = sum(per0), sum(per1)
    return {"replicas": replicas, "tokens_per_batch": tokens, "rate": rate, "seconds": wall, "batches": total,
            "stored": n, "failed": failed,
            "nats_cpu_pct": 100 * (cpu1 - cpu0) / wall, "nats_cpu_us_per_batch": 1e6 * (cpu1 - cpu0) / max(1, n),
            # The stream's leader orders and stores every write: one stream's ceiling is about one core of it.
            "leader_cpu_us_per_batch": 1e6 * (per1[leader] - per0[leader]) / max(1, n),
            "publisher_on_leader": on_leader,
            "route_bytes_per_batch": (routes1 - routes0) / max(1, n),
            "stored_bytes_per_batch": info.state.bytes / max(1, n),
            "disk_bytes_per_batch_all_replicas": disk / max(1, n),
            "puback_ms": latency_stats(round_trips)}


def table(results: list[dict[str, Any]]) -> Table:
    t = Table(title="JetStream replication cost, 3-node cluster on loopback (one host)")
    for col in ("replicas", "tokens / batch", "batches/s", "stored", "nats CPU (3 servers)", "CPU µs / batch",
                "leader µs / batch",
                "route bytes / batch", "stored bytes / batch", "disk bytes / batch (all replicas)",
                "PubAck p50 / p99 ms"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(f"R{r['replicas']}", str(r["tokens_per_batch"]), f"{r['batches'] / r['seconds']:,.0f}",
                  f"{r['stored']:,}", f"{r['nats_cpu_pct']:.0f}%", f"{r['nats_cpu_us_per_batch']:.1f}",
                  f"{r['leader_cpu_us_per_batch']:.1f}",
                  f"{r['route_bytes_per_batch']:.0f}", f"{r['stored_bytes_per_batch']:.0f}",
                  f"{r['disk_bytes_per_batch_all_replicas']:.0f}",
                  f"{r['puback_ms']['p50']:.2f} / {r['puback_ms']['p99']:.2f}")
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=4000.0, help="batches/s")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2, help="R1/R3 pairs, alternated")
    parser.add_argument("--streams", type=int, default=1000, help="distinct token subjects")
    parser.add_argument("--tokens", default="1,8", help="tokens per batch to measure, e.g. 1,8")
    parser.add_argument("--out", default="bench/out/replication.json")
    args = parser.parse_args(argv)
    console = Console(width=160)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), 3) as cluster:
        for _ in range(args.rounds):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for replicas in (1, 3):
                    console.print(f"R{replicas}, {tokens}-token batches: {args.rate:,.0f}/s for {args.seconds:g} s")
                    results.append(eventloop.run(measure(cluster, replicas, args.rate, args.seconds, args.streams,
                                                         tokens)))
    console.print(table(results))
    r1 = [r for r in results if r["replicas"] == 1]
    r3 = [r for r in results if r["replicas"] == 3]
    cpu = sum(r["nats_cpu_us_per_batch"] for r in r3) / sum(r["nats_cpu_us_per_batch"] for r in r1)
    console.print(f"R3 ÷ R1, nats-server CPU per batch (all servers): {cpu:.2f}×")
    out = Path(args.out)
    write_json(out, {"runs": results}, indent=1)
    return 0 if all(r["failed"] == 0 and r["stored"] == r["batches"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
