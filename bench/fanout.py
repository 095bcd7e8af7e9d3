"""Relay fan-out with a SYNTHETIC token source: no model, just batches published to NATS.

    python -m bench.fanout                      # the three default scenarios (about 2 minutes)
    python -m bench.fanout --scenario 10000:20:500

Each scenario (``streams:batches:interval-ms``) starts its own nats-server and one
``tokenpipe relay`` process, opens the SSE connections (raw asyncio clients: httpx would cost
more CPU than the relay), then a :class:`SyntheticSource` publishes every stream's batches
spread evenly over each interval. Reported: batches/s forwarded, the added latency (batch
``emitted`` stamp → client arrival, same host clock, so it includes NATS and the relay), the
relay's CPU per forwarded batch, and its RSS per open stream. The synthetic source starts and
ends every stream within the same interval, so each stream's first and last batch also time
the set-up or tear-down of all the others; "steady" latency leaves those two batches out.
The default scenarios offer 10,000 batches/s over 1,000 streams, 22,222/s over 2,000 streams,
then 20,000/s over 10,000 streams. (The consumer-per-stream and shared-subscription readers
this once compared were removed; docs/perf-history.md has their last figures.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tokenpipe import eventloop
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe.subjects import token_subject
from tokenpipe.wire import StreamMeta, TokenBatch, new_request_id
from tokenpipe_cli.stats import latency_stats

from .common import cpu_seconds, rss_kib, write_json
from .rawhttp import SSEResponse, get_request
from .stack import Relays

DEFAULT_SCENARIOS = ("1000:20:100", "2000:60:90", "10000:20:500")


@dataclass(frozen=True)
class Scenario:
    streams: int
    batches: int
    interval_ms: float

    @classmethod
    def parse(cls, text: str) -> Scenario:
        streams, batches, interval = text.split(":")
        return cls(int(streams), int(batches), float(interval))

    @property
    def offered(self) -> float:
        return self.streams / (self.interval_ms / 1000)

    def __str__(self) -> str:
        return f"{self.streams:,} streams × {self.batches} batches every {self.interval_ms:g} ms"


class SyntheticSource:
    """Stands in for generators (no model involved): meta entries, then each stream's batches
    published round-robin, spread evenly over every interval as many independent generators would."""

    def __init__(self, bus: Bus, streams: int) -> None:
        self.bus = bus
        self.ids = [new_request_id() for _ in range(streams)]

    async def register(self) -> None:
        for sid in self.ids:
            await self.bus.meta.put(sid, StreamMeta(sid, "default", "synthetic", time.time_ns()).encode())

    async def run(self, batches: int, interval: float, tokens_per_batch: int = 4) -> None:
        n = len(self.ids)
        total, sent = n * batches, 0
        rate = n / interval
        t0 = time.perf_counter()
        while sent < total:
            due = min(total, int((time.perf_counter() - t0) * rate) + 1)
            while sent < due:
                seq, sid = divmod(sent, n)
                sid_s = self.ids[sid]
                batch = TokenBatch(id=sid_s, seq=seq, index=seq * tokens_per_batch,
                                   token_ids=tuple(range(tokens_per_batch)), text=" tok" * tokens_per_batch,
                                   finish="length" if seq == batches - 1 else None,
                                   timings={"emitted": time.time_ns()})
                await self.bus.nc.publish(token_subject(self.bus.owner, sid_s), batch.encode())
                sent += 1
            await asyncio.sleep(0.001)  # the synthetic generators' pacing


class _SSEClient(asyncio.Protocol):
    """A minimal SSE reader (:mod:`bench.rawhttp`): counts `tokens` events and their latency from
    the `emitted` stamp."""

    def __init__(self, path: str, latencies: list[int], steady: list[int], last_seq: int,
                 span: list[int], done: asyncio.Future[None]) -> None:
        self.path = path
        self.latencies = latencies
        self.steady = steady  # all but the stream's first and last batch (its set-up and tear-down)
        self.last_seq = last_seq
        self.span = span  # [first, last] arrival (ns) of any steady batch, shared by all clients
        self.done = done
        self.opened: asyncio.Future[None] = done.get_loop().create_future()
        self.response = SSEResponse()
        self.events = 0

    def connection_made(self, transport: Any) -> None:  # uvloop's transports are not asyncio.Transport
        transport.write(get_request(self.path))

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        events = self.response.feed(data)
        if not self.opened.done():
            if self.response.status is None:
                return  # the response head is not complete yet
            if self.response.status != 200:
                self.opened.set_exception(RuntimeError(f"{self.path}: HTTP {self.response.status}"))
                return
            self.opened.set_result(None)
        for ev in events:
            if ev.event == "tokens":
                lat = now - ev.json()["timings"]["emitted"]
                self.latencies.append(lat)
                if 0 < self.events < self.last_seq:
                    self.steady.append(lat)
                    if not self.span[0]:
                        self.span[0] = now
                    self.span[1] = now
                self.events += 1
            elif ev.event in ("done", "error") and not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"{self.path}: connection lost ({exc})"))


async def nats_round_trip(bus: Bus, n: int = 2000) -> dict[str, float]:
    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    sub = await bus.nc.subscribe("bench.echo", cb=echo)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await bus.nc.request("bench.echo", b"x" * 64, timeout=5)
        samples.append(time.perf_counter() - t0)
    await sub.unsubscribe()
    return latency_stats(samples)


async def _drive(port: int, source: SyntheticSource, sc: Scenario, relay_pid: int, nats_pid: int,
                 progress: Progress) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    latencies: list[int] = []
    steady: list[int] = []
    span = [0, 0]
    clients: list[_SSEClient] = []
    transports: list[asyncio.BaseTransport] = []
    base_rss = rss_kib(relay_pid)
    task = progress.add_task(f"opening {sc.streams:,} SSE streams", total=sc.streams)
    gate = asyncio.Semaphore(256)  # the relay's accept backlog is finite

    async def open_one(sid: str) -> None:
        async with gate:
            client = _SSEClient(f"/v1/streams/{sid}", latencies, steady, sc.batches - 1, span, loop.create_future())
            transport, _ = await loop.create_connection(lambda: client, "127.0.0.1", port)
            transports.append(transport)
            clients.append(client)
            await client.opened
            progress.advance(task)

    t_open = time.perf_counter()
    await asyncio.gather(*(open_one(sid) for sid in source.ids))
    open_s = time.perf_counter() - t_open
    open_rss, cpu0 = rss_kib(relay_pid), cpu_seconds(relay_pid)
    nats0, own0 = cpu_seconds(nats_pid), time.process_time()
    fwd = progress.add_task("forwarding", total=sc.streams * sc.batches)
    t0 = time.perf_counter()
    publisher = asyncio.create_task(source.run(sc.batches, sc.interval_ms / 1000))
    while not all(c.done.done() for c in clients):
        await asyncio.sleep(0.2)  # progress display only; completion is the clients' futures
        progress.update(fwd, completed=len(latencies))
    wall = time.perf_counter() - t0
    await publisher
    cpu1 = cpu_seconds(relay_pid)
    nats1, own1 = cpu_seconds(nats_pid), time.process_time()
    progress.update(fwd, completed=len(latencies))
    for t in transports:
        t.close()
    errors = [c.done.exception() for c in clients if c.done.exception()]
    received = len(latencies)
    return {"batches_received": received, "batches_expected": sc.streams * sc.batches, "errors": len(errors),
            "open_s": open_s, "batches_s": received / wall, "offered_batches_s": sc.offered,
            "steady_batches_s": len(steady) / max(1e-9, (span[1] - span[0]) / 1e9),
            "added_latency_ms": latency_stats([v / 1e9 for v in latencies]),
            "added_latency_steady_ms": latency_stats([v / 1e9 for v in steady]),
            "relay_cpu_pct": 100 * (cpu1 - cpu0) / wall,
            "relay_cpu_us_per_batch": 1e6 * (cpu1 - cpu0) / max(1, received),
            "nats_cpu_pct": 100 * (nats1 - nats0) / wall, "bench_cpu_pct": 100 * (own1 - own0) / wall,
            "rss_per_stream_kib": (open_rss - base_rss) / sc.streams, "relay_rss_open_kib": open_rss}


def run_scenario(sc: Scenario, console: Console) -> dict[str, Any]:
    with Relays() as stack:
        settings = Settings.load(env={}, nats_url=stack.nats.url, data_dir=stack.data_dir)

        async def run() -> dict[str, Any]:
            bus = await connect(settings, name="bench-fanout")
            try:
                rtt = await nats_round_trip(bus)
                source = SyntheticSource(bus, sc.streams)
                await source.register()
                with Progress(console=console, transient=True) as progress:
                    result = await _drive(stack.ports[0], source, sc, stack.children[0].pid, stack.nats_pid, progress)
                return {"nats_round_trip_ms": rtt, **result}
            finally:
                await bus.close()

        return {"scenario": str(sc), **vars(sc), **eventloop.run(run())}


def results_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="relay fan-out, SYNTHETIC token source")
    for col in ("streams", "offered/s", "forwarded/s", "steady /s", "added p50 / p99 ms",
                "steady p50 / p99 ms", "relay CPU", "CPU µs/batch", "RSS/stream KiB", "open s", "nats / bench CPU"):
        table.add_column(col, justify="right")
    for r in results:
        lat, st = r["added_latency_ms"], r["added_latency_steady_ms"]
        table.add_row(f"{r['streams']:,}", f"{r['offered_batches_s']:,.0f}", f"{r['batches_s']:,.0f}",
                      f"{r['steady_batches_s']:,.0f}",
                      f"{lat['p50']:.1f} / {lat['p99']:.1f}", f"{st['p50']:.1f} / {st['p99']:.1f}",
                      f"{r['relay_cpu_pct']:.0f}%",
                      f"{r['relay_cpu_us_per_batch']:.0f}", f"{r['rss_per_stream_kib']:.1f}", f"{r['open_s']:.1f}",
                      f"{r['nats_cpu_pct']:.0f}% / {r['bench_cpu_pct']:.0f}%")
    return table


def fanout_goals(results: list[dict[str, Any]]) -> dict[str, tuple[bool, str]]:
    """The issue's two fan-out goals, each judged on the scenarios that test it."""
    big = [r for r in results if r["streams"] >= 10_000]
    fast = [r for r in results if r["offered_batches_s"] >= 20_000]
    mem = min((r["rss_per_stream_kib"] for r in big), default=None)
    meeting = [r for r in fast if r["steady_batches_s"] >= 20_000 and r["added_latency_steady_ms"]["p99"] <= 5]
    ranked = meeting or sorted(fast, key=lambda r: r["added_latency_steady_ms"]["p99"])
    best = ranked[0] if ranked else None
    return {
        "10,000 SSE streams at <= 50 KiB RSS each": (
            mem is not None and mem <= 50, "not run" if mem is None else f"{mem:.1f} KiB"),
        ">= 20,000 batches/s forwarded at steady-state p99 added latency <= 5 ms": (
            bool(meeting),
            "not run" if best is None else
            f"{best['steady_batches_s']:,.0f}/s at steady p99 {best['added_latency_steady_ms']['p99']:.1f} ms "
            f"({best['streams']:,} streams)"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", type=Scenario.parse,
                        help="streams:batches:interval_ms (repeatable); default: " + " ".join(DEFAULT_SCENARIOS))
    parser.add_argument("--out", default="bench/out/fanout.json")
    args = parser.parse_args(argv)
    scenarios = args.scenario or [Scenario.parse(s) for s in DEFAULT_SCENARIOS]
    console = Console(width=150)
    results = []
    for sc in scenarios:
        console.print(f"[bold]{sc}[/bold]")
        results.append(run_scenario(sc, console))
    console.print(results_table(results))
    goals = fanout_goals(results)
    gt = Table(title="Goals (benchmark issue, relay fan-out)")
    for col in ("goal", "best measured", ""):
        gt.add_column(col)
    for name, (met, measured) in goals.items():
        gt.add_row(name, measured, "[green]met[/]" if met else "[red]not met[/]")
    console.print(gt)
    rtt = results[0]["nats_round_trip_ms"]
    console.print(f"NATS request/reply round trip p50 / p99: {rtt['p50']:.3f} / {rtt['p99']:.3f} ms")
    out = Path(args.out)
    write_json(out, {"scenarios": results, "goals": {k: v[0] for k, v in goals.items()}}, indent=1)
    return 0 if all(r["batches_received"] == r["batches_expected"] and not r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
