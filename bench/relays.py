"""Relays scaling out: K relays, each serving 1/K of the streams.

    python -m bench.relays                              # 1,000 streams at 5,000 batches/s, K = 1, 2, 4 (~1 min)
    python -m bench.relays --streams 2000 --rate 8000 --relays 1,2,4,8

Per run: one nats-server, K ``tokenpipe relay`` processes, and a SYNTHETIC token source
(``bench.fanout.SyntheticSource``: meta entries, then 4-token batches for every stream spread
evenly over each interval). Stream ``i``'s SSE client connects to relay ``i % K``, as a load
balancer would spread them. The question is whether adding relays adds capacity: a relay
subscribes per stream it serves, so it receives only those streams' batches.

Each run also starts a bystander: one more relay that serves no stream. Its CPU per batch
published anywhere is what a relay pays for traffic that is not its own (next to nothing with
per-stream subscriptions; the removed shared subscription paid for every batch, see
docs/perf-history.md).

Reported per run: batches delivered per second, every relay's CPU, their sum per delivered
batch, the busiest relay, what one relay core would deliver at that cost, the bystander's
cost per published batch, nats-server's CPU, and the steady added latency. The ratios are
within one run (this machine is noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenpipe import eventloop
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe_cli.natsserver import NatsServer
from tokenpipe_cli.stats import latency_stats

from .common import cpu_seconds, rss_kib, write_json
from .fanout import SyntheticSource, _SSEClient
from .stack import Relays

__all__ = ["main", "run_one"]


async def _drive(nats: NatsServer, ports: list[int], pids: list[int], bystander: int, streams: int, rate: float,
                 batches: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    settings = Settings.load(env={}, nats_url=nats.url, replicas="1")
    bus = await connect(settings, name="bench-relays")
    try:
        source = SyntheticSource(bus, streams)
        await source.register()
        k = len(ports)
        latencies: list[list[int]] = [[] for _ in ports]
        steady: list[int] = []
        span = [0, 0]
        clients: list[_SSEClient] = []
        transports: list[Any] = []
        base_rss = [rss_kib(p) for p in pids]
        gate = asyncio.Semaphore(256)  # the relays' accept backlogs are finite

        async def open_one(i: int, sid: str) -> None:
            async with gate:
                client = _SSEClient(f"/v1/streams/{sid}", latencies[i % k], steady, batches - 1, span,
                                    loop.create_future())
                transport, _ = await loop.create_connection(lambda: client, "127.0.0.1", ports[i % k])
                transports.append(transport)
                clients.append(client)
                await client.opened

        await asyncio.gather(*(open_one(i, sid) for i, sid in enumerate(source.ids)))
        rss = [(rss_kib(p) - b) / (streams / k) for p, b in zip(pids, base_rss, strict=True)]
        assert nats.pid is not None
        cpu0, nats0, idle0 = [cpu_seconds(p) for p in pids], cpu_seconds(nats.pid), cpu_seconds(bystander)
        t0 = time.perf_counter()
        await source.run(batches, streams / rate)
        await asyncio.wait_for(asyncio.gather(*(c.done for c in clients), return_exceptions=True), 120)
        wall = time.perf_counter() - t0
        cpu1, nats1, idle1 = [cpu_seconds(p) for p in pids], cpu_seconds(nats.pid), cpu_seconds(bystander)
        for t in transports:
            t.close()
    finally:
        await bus.close()
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    delivered = [len(x) for x in latencies]
    total = sum(delivered)
    per_batch_us = 1e6 * sum(cpu) / max(1, total)
    return {
        "relays": k, "streams": streams, "offered_batches_s": rate, "batches_expected": streams * batches,
        "batches_delivered": total, "delivered_batches_s": total / wall,
        "relay_cpu_pct": [100 * c / wall for c in cpu], "relay_cpu_us_per_delivered_batch": per_batch_us,
        "busiest_relay_cpu_pct": 100 * max(cpu) / wall,
        "batches_s_per_relay_core": 1e6 / per_batch_us if per_batch_us else 0.0,
        "nats_cpu_pct": 100 * (nats1 - nats0) / wall,
        "bystander_cpu_us_per_published_batch": 1e6 * (idle1 - idle0) / (streams * batches),
        "rss_per_stream_kib": sum(rss) / len(rss),
        "steady_latency_ms": latency_stats([v / 1e9 for v in steady]),
    }


def run_one(relays: int, streams: int, rate: float, batches: int) -> dict[str, Any]:
    """One run: a fresh nats-server and ``relays`` relay processes."""
    with Relays(relays + 1) as stack:  # the last one is the bystander
        pids = [c.pid for c in stack.children]
        return eventloop.run(_drive(stack.nats, stack.ports[:-1], pids[:-1], pids[-1], streams, rate, batches))


def table(results: list[dict[str, Any]]) -> Table:
    t = Table(title="relays scaling out, SYNTHETIC token source (each relay serves 1/K of the streams)")
    for col in ("relays", "streams/relay", "offered/s", "delivered/s", "relay CPU (each)",
                "busiest relay", "relay CPU µs / delivered batch", "× K=1", "batches/s per relay core",
                "bystander µs / batch", "nats CPU", "RSS/stream KiB", "steady p50 / p99 ms"):
        t.add_column(col, justify="right")
    base = next((r["relay_cpu_us_per_delivered_batch"] for r in results if r["relays"] == 1), float("nan"))
    for r in results:
        lat = r["steady_latency_ms"]
        ratio = r["relay_cpu_us_per_delivered_batch"] / base
        t.add_row(str(r["relays"]), f"{r['streams'] // r['relays']:,}", f"{r['offered_batches_s']:,.0f}",
                  f"{r['delivered_batches_s']:,.0f}", " ".join(f"{c:.0f}%" for c in r["relay_cpu_pct"]),
                  f"{r['busiest_relay_cpu_pct']:.0f}%", f"{r['relay_cpu_us_per_delivered_batch']:.0f}",
                  f"{ratio:.2f}", f"{r['batches_s_per_relay_core']:,.0f}",
                  f"{r['bystander_cpu_us_per_published_batch']:.1f}", f"{r['nats_cpu_pct']:.0f}%",
                  f"{r['rss_per_stream_kib']:.1f}", f"{lat['p50']:.1f} / {lat['p99']:.1f}")
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=5000.0, help="batches/s offered, over all streams")
    parser.add_argument("--batches", type=int, default=50, help="batches per stream")
    parser.add_argument("--relays", default="1,2,4", help="relay counts to run, e.g. 1,2,4")
    parser.add_argument("--out", default="bench/out/relays.json")
    args = parser.parse_args(argv)
    console = Console(width=180)
    results = []
    for k in (int(x) for x in args.relays.split(",")):
        console.print(f"[bold]{k} relay(s)[/bold], {args.streams:,} streams at {args.rate:,.0f}/s")
        results.append(run_one(k, args.streams, args.rate, args.batches))
    console.print(table(results))
    out = Path(args.out)
    write_json(out, {"runs": results}, indent=1)
    return 0 if all(r["batches_delivered"] == r["batches_expected"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
