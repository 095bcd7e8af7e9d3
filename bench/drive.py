"""The pipeline benchmark's HTTP phases: TTFT at one stream, then rounds of concurrent streams.

Each phase runs the minimal client (:mod:`bench.rawhttp`, what the pipeline itself costs) and
httpx (what a client library adds) alternately, so both see the same machine state.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from rich.progress import Progress

from producer import RelayClient
from tokenpipe_cli.loadgen import Record, native_stream

from .common import chat
from .rawhttp import raw_stream

__all__ = ["Round", "Runs", "drive", "drive_ttft", "one_stream"]

Round = tuple[list[Record], float]  # one round's records and its wall time (s)


@dataclass
class Runs:
    singles: list[Record]  # one stream at a time, minimal client
    singles_httpx: list[Record]
    rounds: list[Round]  # ``streams`` at once, minimal client
    rounds_httpx: list[Round]


async def one_stream(relay: RelayClient, body: dict[str, Any]) -> Record:
    """One request over the native API through httpx, timed from the POST (the load generator's own path)."""
    rec = Record(ok=False, start=time.perf_counter())
    await native_stream(relay, body, rec)
    rec.e2e = time.perf_counter() - rec.start
    rec.ok = rec.finish in ("length", "stop")
    return rec


async def drive(url: str, args: argparse.Namespace, progress: Progress) -> Runs:
    limits = httpx.Limits(max_connections=args.streams * 2 + 4, max_keepalive_connections=args.streams * 2 + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        relay = RelayClient(http=client)
        base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        # warm-up: first request pays one-time costs (thread pools, allocator)
        await one_stream(relay, {"messages": chat(999), **base, "max_tokens": 8})
        singles, singles_httpx = await _ttft_probe(url, relay, base, args.ttft_requests, progress)
        task = progress.add_task(f"{args.streams} concurrent streams × {args.repeats} × 2 clients",
                                 total=args.streams * args.repeats * 2)

        async def tracked(i: int, httpx_client: bool) -> Record:
            body = {"messages": chat(i), **base}
            res = await (one_stream(relay, body) if httpx_client else raw_stream(url, body))
            progress.advance(task)
            return res

        # A short burst first, like the in-process engine had (its sweep ran these batch shapes).
        await asyncio.gather(*(one_stream(relay, {"messages": chat(i), **base, "max_tokens": 4})
                               for i in range(args.streams)))
        # The minimal client measures the pipeline; httpx, alternating with it, what a client
        # library adds (on 2 cores its CPU is taken from the engine's OpenMP team too).
        rounds: list[Round] = []
        rounds_httpx: list[Round] = []
        for _ in range(args.repeats):
            for httpx_client, out in ((False, rounds), (True, rounds_httpx)):
                t0 = time.perf_counter()
                many = await asyncio.gather(*(tracked(i, httpx_client) for i in range(args.streams)))
                out.append((many, time.perf_counter() - t0))
    return Runs(singles, singles_httpx, rounds, rounds_httpx)


async def drive_ttft(url: str, args: argparse.Namespace, progress: Progress) -> tuple[list[Record], list[Record]]:
    """The TTFT phase alone (``--only ttft``): the same warm-up, then the same probe."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        relay = RelayClient(http=client)
        base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        await one_stream(relay, {"messages": chat(999), **base, "max_tokens": 8})
        return await _ttft_probe(url, relay, base, args.ttft_requests, progress)


async def _ttft_probe(url: str, relay: RelayClient, base: dict[str, Any], requests: int,
                      progress: Progress) -> tuple[list[Record], list[Record]]:
    task = progress.add_task("TTFT at 1 stream", total=requests)
    singles, singles_httpx = [], []
    for i in range(requests):  # interleaved, so both clients see the same conditions
        singles.append(await raw_stream(url, {"messages": chat(i), **base, "max_tokens": 4}))
        singles_httpx.append(await one_stream(relay, {"messages": chat(i), **base, "max_tokens": 4}))
        progress.advance(task)
    return singles, singles_httpx
