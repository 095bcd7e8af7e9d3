"""Relay fan-out with a SYNTHETIC token source: no model, just batches published to NATS.

    python -m bench.fanout [--streams 1000] [--batches 20] [--interval-ms 50]

Starts nats-server and one `tokenpipe relay` process, opens ``--streams`` SSE connections
(each a stream whose meta entry and batches come from :class:`SyntheticSource`), publishes
``--batches`` batches per stream every ``--interval-ms``, and reports batches/s forwarded,
the added latency (batch ``emitted`` stamp → client arrival, same host clock), relay RSS per
open stream, and the NATS core request/reply round trip as a ceiling for one hop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tokenpipe.bus import Bus, connect
from tokenpipe.natsserver import NatsServer, free_port
from tokenpipe.settings import Settings
from tokenpipe.streams import StreamMeta
from tokenpipe.subjects import token_subject
from tokenpipe.wire import TokenBatch, new_request_id

from .loadgen import latency_stats


class SyntheticSource:
    """Stands in for generators: meta entries plus timed token batches (no model involved)."""

    def __init__(self, bus: Bus, streams: int) -> None:
        self.bus = bus
        self.ids = [new_request_id() for _ in range(streams)]

    async def register(self) -> None:
        for sid in self.ids:
            await self.bus.meta.put(sid, StreamMeta(sid, "default", "synthetic", time.time_ns()).encode())

    async def run(self, batches: int, interval: float, tokens_per_batch: int = 4) -> None:
        for seq in range(batches):
            final = seq == batches - 1
            for sid in self.ids:
                batch = TokenBatch(id=sid, seq=seq, index=seq * tokens_per_batch,
                                   token_ids=tuple(range(tokens_per_batch)), text=" tok" * tokens_per_batch,
                                   finish="length" if final else None, timings={"emitted": time.time_ns()})
                await self.bus.nc.publish(token_subject(sid), batch.encode())
            await self.bus.nc.flush()
            await asyncio.sleep(interval)  # the synthetic generator's pacing


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


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


async def drive(url: str, source: SyntheticSource, args: argparse.Namespace, relay_pid: int,
                progress: Progress) -> dict[str, Any]:
    latencies: list[float] = []
    received = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    opened = asyncio.Event()
    open_count = 0
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        task = progress.add_task("streams done", total=len(source.ids))

        async def reader(sid: str) -> None:
            nonlocal received, open_count
            async with client.stream("GET", f"/v1/streams/{sid}") as resp:
                open_count += 1
                if open_count == len(source.ids):
                    opened.set()
                event = ""
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event == "tokens":
                        data = json.loads(line[5:])
                        latencies.append((time.time_ns() - data["timings"]["emitted"]) / 1e9)
                        received += 1
                    elif line.startswith("data:") and event in ("done", "error"):
                        break
            progress.advance(task)

        base_rss = rss_kib(relay_pid)
        readers = [asyncio.create_task(reader(sid)) for sid in source.ids]
        await asyncio.wait_for(opened.wait(), 300)
        open_rss = rss_kib(relay_pid)
        t0 = time.perf_counter()
        await source.run(args.batches, args.interval_ms / 1000)
        await asyncio.gather(*readers)
        wall = time.perf_counter() - t0
    return {"batches_received": received, "batches_expected": len(source.ids) * args.batches,
            "batches_s": received / wall, "added_latency_ms": latency_stats(latencies),
            "rss_per_stream_kib": (open_rss - base_rss) / len(source.ids), "relay_rss_open_kib": open_rss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    parser.add_argument("--out", default="bench/out/fanout.json")
    args = parser.parse_args(argv)
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as nats:
        port = free_port()
        settings = Settings.load(env={}, nats_url=nats.url, data_dir=tmp)
        relay = subprocess.Popen([sys.executable, "-m", "tokenpipe", "relay", "--nats-url", nats.url, "--data-dir", tmp,
                                  "--port", str(port), "--log-level", "WARNING"])
        try:
            async def run() -> dict[str, Any]:
                bus = await connect(settings, name="bench-fanout")
                try:
                    url = f"http://127.0.0.1:{port}"
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        try:
                            async with httpx.AsyncClient() as c:
                                if (await c.get(url + "/healthz")).status_code == 200:
                                    break
                        except httpx.HTTPError:
                            await asyncio.sleep(0.2)  # the relay process is still starting
                    rtt = await nats_round_trip(bus)
                    source = SyntheticSource(bus, args.streams)
                    await source.register()
                    with Progress(console=console) as progress:
                        result = await drive(url, source, args, relay.pid, progress)
                    return {"nats_round_trip_ms": {k: v for k, v in rtt.items()}, **result}
                finally:
                    await bus.close()

            result = asyncio.run(run())
        finally:
            relay.terminate()
            relay.wait(20)
    table = Table(title=f"relay fan-out, SYNTHETIC token source — {args.streams} streams × {args.batches} batches "
                        f"every {args.interval_ms:g} ms")
    table.add_column("what")
    table.add_column("value", justify="right")
    lat, rtt = result["added_latency_ms"], result["nats_round_trip_ms"]
    table.add_row("batches forwarded / expected", f"{result['batches_received']} / {result['batches_expected']}")
    table.add_row("batches/s forwarded", f"{result['batches_s']:,.0f}")
    table.add_row("added latency p50 / p99 (emitted → client)", f"{lat['p50']:.1f} / {lat['p99']:.1f} ms")
    table.add_row("relay RSS per open stream", f"{result['rss_per_stream_kib']:.1f} KiB")
    table.add_row("NATS request/reply round trip p50 / p99", f"{rtt['p50']:.3f} / {rtt['p99']:.3f} ms")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), **result}, indent=1))
    return 0 if result["batches_received"] == result["batches_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
