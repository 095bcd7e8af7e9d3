"""Relay cost per stream, WebSocket vs SSE, with a SYNTHETIC token source (a relay load benchmark).

    python -m bench.transports                          # 1,000 streams: 1,000 SSE connections vs 100 sockets
    python -m bench.transports --streams 200 --sockets 20 --repeats 1

Each run starts its own nats-server and one ``tokenpipe relay`` process (default fan-out). A
:class:`bench.fanout.SyntheticSource` (no model: meta entries, then 4-token batches for every
stream spread evenly over each interval) feeds the same number of streams to either
``--streams`` SSE connections (``GET /v1/streams/{id}``) or ``--sockets`` WebSockets on
``/v1/ws``, each attached to ``streams / sockets`` streams (both raw asyncio clients, so this
process is not the bottleneck; its CPU is reported).
Reported per run: the relay's RSS per open stream (after opening them all, before
any batch), its CPU per delivered batch and per stream-second, and the steady added latency
(the batch's ``emitted`` stamp to its arrival at the client). Runs alternate SSE, WebSocket,
SSE, ... so drift on a shared machine hits both alike; the summary gives WebSocket ÷ SSE ratios
of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from tokenpipe import eventloop
from tokenpipe.bus import connect as connect_bus
from tokenpipe.settings import Settings
from tokenpipe_cli.stats import latency_stats

from .common import cpu_seconds, rss_kib, write_json
from .fanout import SyntheticSource, _SSEClient
from .stack import Relays

__all__ = ["main", "run_one"]


def _masked(opcode: int, payload: bytes) -> bytes:
    """A client frame (clients must mask); the payloads here are short."""
    mask = os.urandom(4)
    head = bytes([0x80 | opcode])
    n = len(payload)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class _Socket(asyncio.Protocol):
    """A minimal ``/v1/ws`` client (raw asyncio, as the SSE clients: a client library would cost
    this process more CPU than the relay) attached to several streams: counts ``tokens`` frames
    and their latency from the ``emitted`` stamp; answers the relay's pings."""

    def __init__(self, ids: list[str], latencies: list[int], steady: list[int], last_seq: int) -> None:
        self.ids, self.latencies, self.steady, self.last_seq = ids, latencies, steady, last_seq
        loop = asyncio.get_running_loop()
        self.upgraded: asyncio.Future[None] = loop.create_future()
        self.attached: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.buf = b""
        self.waiting, self.open_streams = set(ids), set(ids)
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        transport.write((f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())

    async def attach(self) -> None:
        await self.upgraded
        self.transport.write(b"".join(_masked(0x1, json.dumps({"type": "attach", "id": sid}).encode())
                                      for sid in self.ids))
        await self.attached

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        self.buf += data
        if not self.upgraded.done():
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            if not head.startswith(b"HTTP/1.1 101"):
                self.upgraded.set_exception(RuntimeError(head.decode(errors="replace")))
                return
            self.buf = rest
            self.upgraded.set_result(None)
        buf, pos = self.buf, 0
        while len(buf) - pos >= 2:
            opcode, n = buf[pos] & 0x0F, buf[pos + 1] & 0x7F
            start = pos + 2
            if n == 126:
                if len(buf) - pos < 4:
                    break
                n, start = struct.unpack_from("!H", buf, pos + 2)[0], pos + 4
            elif n == 127:
                if len(buf) - pos < 10:
                    break
                n, start = struct.unpack_from("!Q", buf, pos + 2)[0], pos + 10
            if len(buf) < start + n:
                break
            payload = buf[start:start + n]
            pos = start + n
            if opcode == 0x1:
                self._frame(orjson.loads(payload), now)
            elif opcode == 0x9:
                self.transport.write(_masked(0xA, payload))
        self.buf = buf[pos:]

    def _frame(self, frame: dict[str, Any], now: int) -> None:
        kind = frame["type"]
        if kind == "tokens":
            lat = now - frame["timings"]["emitted"]
            self.latencies.append(lat)
            if 0 < frame["seq"] < self.last_seq:
                self.steady.append(lat)
        elif kind == "attached":
            self.waiting.discard(frame["id"])
            if not self.waiting and not self.attached.done():
                self.attached.set_result(None)
        elif kind == "done":
            self.open_streams.discard(frame["id"])
            if not self.open_streams and not self.done.done():
                self.done.set_result(None)
        elif kind == "error":
            for future in (self.upgraded, self.attached, self.done):
                if not future.done():
                    future.set_exception(RuntimeError(f"error frame: {frame}"))

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.upgraded, self.attached, self.done):
            if not future.done():
                future.set_exception(ConnectionError(f"socket closed ({exc})"))


async def _open_sse(port: int, ids: list[str], latencies: list[int], steady: list[int],
                    last_seq: int) -> tuple[list[asyncio.Future[None]], list[Any]]:
    loop = asyncio.get_running_loop()
    done: list[asyncio.Future[None]] = []
    transports: list[Any] = []
    span = [0, 0]
    gate = asyncio.Semaphore(256)  # the relay's accept backlog is finite

    async def open_one(sid: str) -> None:
        async with gate:
            client = _SSEClient(f"/v1/streams/{sid}", latencies, steady, last_seq, span, loop.create_future())
            transport, _ = await loop.create_connection(lambda: client, "127.0.0.1", port)
            transports.append(transport)
            done.append(client.done)
            await client.opened

    await asyncio.gather(*(open_one(sid) for sid in ids))
    return done, transports


async def _open_ws(port: int, ids: list[str], sockets: int, latencies: list[int], steady: list[int],
                   last_seq: int) -> tuple[list[asyncio.Future[None]], list[Any]]:
    loop = asyncio.get_running_loop()
    per = -(-len(ids) // sockets)
    clients, transports = [], []
    for i in range(sockets):
        client = _Socket(ids[i * per:(i + 1) * per], latencies, steady, last_seq)
        transport, _ = await loop.create_connection(lambda c=client: c, "127.0.0.1", port)  # type: ignore[misc]
        clients.append(client)
        transports.append(transport)
    await asyncio.gather(*(c.attach() for c in clients))
    return [c.done for c in clients], transports


async def _drive(transport: str, port: int, relay_pid: int, nats_url: str, streams: int, sockets: int,
                 batches: int, rate: float) -> dict[str, Any]:
    bus = await connect_bus(Settings.load(env={}, nats_url=nats_url, replicas="1"), name="bench-transports")
    try:
        source = SyntheticSource(bus, streams)
        await source.register()
        latencies: list[int] = []
        steady: list[int] = []
        base_rss = rss_kib(relay_pid)
        t_open = time.perf_counter()
        closers: list[Any]
        if transport == "sse":
            done, closers = await _open_sse(port, source.ids, latencies, steady, batches - 1)
        else:
            done, closers = await _open_ws(port, source.ids, sockets, latencies, steady, batches - 1)
        open_s = time.perf_counter() - t_open
        open_rss = rss_kib(relay_pid)
        cpu0, own0 = cpu_seconds(relay_pid), time.process_time()
        t0 = time.perf_counter()
        await source.run(batches, streams / rate)
        await asyncio.wait_for(asyncio.gather(*done), 120)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(relay_pid) - cpu0
        own = time.process_time() - own0
        for closer in closers:
            closer.close()
    finally:
        await bus.close()
    return {"transport": transport, "streams": streams, "connections": streams if transport == "sse" else sockets,
            "batches_expected": streams * batches, "batches_delivered": len(latencies),
            "offered_batches_s": rate, "delivered_batches_s": len(latencies) / wall, "open_s": open_s,
            "rss_per_stream_kib": (open_rss - base_rss) / streams, "relay_rss_open_kib": open_rss,
            "relay_cpu_pct": 100 * cpu / wall, "relay_cpu_us_per_batch": 1e6 * cpu / max(1, len(latencies)),
            "relay_cpu_ms_per_stream_s": 1e3 * cpu / (streams * wall), "bench_cpu_pct": 100 * own / wall,
            "steady_latency_ms": latency_stats([v / 1e9 for v in steady])}


def run_one(transport: str, streams: int, sockets: int, batches: int, rate: float) -> dict[str, Any]:
    """One run on a fresh nats-server and relay process."""
    with Relays() as stack:
        return eventloop.run(_drive(transport, stack.ports[0], stack.children[0].pid, stack.nats.url, streams, sockets,
                                    batches, rate))


def table(results: list[dict[str, Any]]) -> Table:
    t = Table(title="relay per stream, WebSocket vs SSE, SYNTHETIC token source")
    for col in ("transport", "streams", "connections", "delivered/s", "relay CPU", "CPU µs / batch",
                "CPU ms / stream·s", "RSS / stream KiB", "open s", "steady p50 / p99 ms", "bench CPU"):
        t.add_column(col, justify="right")
    for r in results:
        lat = r["steady_latency_ms"]
        t.add_row(r["transport"], f"{r['streams']:,}", f"{r['connections']:,}", f"{r['delivered_batches_s']:,.0f}",
                  f"{r['relay_cpu_pct']:.0f}%", f"{r['relay_cpu_us_per_batch']:.1f}",
                  f"{r['relay_cpu_ms_per_stream_s']:.3f}", f"{r['rss_per_stream_kib']:.1f}", f"{r['open_s']:.1f}",
                  f"{lat['p50']:.1f} / {lat['p99']:.1f}", f"{r['bench_cpu_pct']:.0f}%")
    return t


def ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """WebSocket ÷ SSE, medians over the runs of each."""
    def med(transport: str, key: str) -> float:
        return statistics.median(r[key] for r in results if r["transport"] == transport)

    return {key: med("websocket", key) / med("sse", key) for key in
            ("relay_cpu_us_per_batch", "rss_per_stream_kib") if med("sse", key) > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--sockets", type=int, default=100, help="WebSockets carrying the streams")
    parser.add_argument("--batches", type=int, default=50, help="batches per stream")
    parser.add_argument("--rate", type=float, default=5000.0, help="batches/s offered, over all streams")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each transport, alternating")
    parser.add_argument("--out", default="bench/out/transports.json")
    args = parser.parse_args(argv)
    console = Console(width=160)
    results = []
    for i in range(args.repeats):
        for transport in ("sse", "websocket"):
            connections = args.streams if transport == "sse" else args.sockets
            console.print(f"run {i + 1}/{args.repeats}: [bold]{transport}[/bold], {args.streams:,} streams over "
                          f"{connections:,} connections at {args.rate:,.0f} batches/s", highlight=False)
            results.append(run_one(transport, args.streams, args.sockets, args.batches, args.rate))
    console.print(table(results))
    summary = ratios(results)
    console.print("WebSocket ÷ SSE (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    out = Path(args.out)
    write_json(out, {"runs": results, "websocket_over_sse": summary}, indent=1)
    return 0 if all(r["batches_delivered"] == r["batches_expected"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
