"""What the single-writer rule costs: conditional appends against the old unconditional publish, one run.

    python -m bench.appends [--streams 32] [--batches 200] [--rate 50] [--first 200] [--out bench/out/appends.json]

Both variants run against the same real nats-server (file store, ``TP_TOKENS`` as provisioned):

- ``conditional`` (what the generator does now, :class:`generator.publisher.BatchPublisher`): per
  stream one append in flight, each with ``Nats-Expected-Last-Subject-Sequence`` from the previous
  PubAck, and a live copy on ``tp.live.<owner>.<id>`` once stored;
- ``unconditional`` (what it did before): every batch ``publish_async`` at once, PubAcks checked
  in order afterwards, live readers served by the core copy of the publish itself (before storage).

Figures, each a ratio within this run:

- **paced**: ``--streams`` streams each publishing a batch every ``1/--rate`` s (a generator at
  that many streams with the 20 ms coalescing window), for ``--batches`` batches per stream: the
  generator process's CPU seconds per 1,000 batches (its event loop shares the GIL with the
  engine, so this is what the pipeline's tokens/s pays) and the batches/s reached;
- **flat out**: the same streams publishing as fast as the publisher takes them: batches/s;
- **first batch**: ``--first`` new streams one after another, each one batch: publish call to
  arrival at a live subscriber (what a client's TTFT gains or loses), p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from generator.service.publisher import BatchPublisher
from tokenpipe.append import StreamLost
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe.subjects import RELAY_OWNER, live_subject, token_subject
from tokenpipe.wire import TokenBatch

__all__ = ["main"]


class Unconditional:
    """The publisher before the single-writer rule, reduced to its cost: publish_async per batch
    (no wait), PubAcks confirmed in order afterwards; live readers get the publish itself."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.pending: list[asyncio.Future[Any]] = []

    async def start(self) -> None:
        return None

    async def publish(self, sid: str, data: bytes, headers: dict[str, str]) -> None:
        self.pending.append(await self.bus.js.publish_async(token_subject(RELAY_OWNER, sid), data, headers=headers))

    async def flush(self) -> None:
        for fut in self.pending:
            await fut
        self.pending.clear()

    @staticmethod
    def live(sid: str) -> str:
        return token_subject(RELAY_OWNER, sid)


class Conditional:
    def __init__(self, bus: Bus) -> None:
        self.pub = BatchPublisher(bus)
        self.chains: dict[str, Any] = {}

    async def start(self) -> None:
        await self.pub.start()

    async def publish(self, sid: str, data: bytes, headers: dict[str, str]) -> None:
        chain = self.chains.get(sid)
        if chain is None:
            chain = self.chains[sid] = self.pub.chain(RELAY_OWNER, sid, last=0, on_lost=_never)
        self.pub.publish(chain, data, headers)

    async def flush(self) -> None:
        await self.pub.flush()

    @staticmethod
    def live(sid: str) -> str:
        return live_subject(RELAY_OWNER, sid)


def _never(exc: StreamLost) -> None:
    raise AssertionError(f"a bench stream was lost: {exc}")


def _batch(sid: str, seq: int) -> tuple[bytes, dict[str, str]]:
    b = TokenBatch(id=sid, seq=seq, index=8 * seq, token_ids=tuple(range(8)), text="x" * 24,
                   timings={"emitted": time.time_ns()})
    return b.encode(), {"Nats-Msg-Id": f"{RELAY_OWNER}:{sid}:{seq}:bench",
                        "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}


async def _paced(variant: Any, streams: int, batches: int, rate: float) -> dict[str, float]:
    ids = [f"b{secrets.token_hex(5)}" for _ in range(streams)]
    period = 1.0 / rate
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(batches):
        tick = t0 + i * period
        for sid in ids:
            await variant.publish(sid, *_batch(sid, i))
        await asyncio.sleep(max(0.0, tick + period - time.perf_counter()))
    await variant.flush()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    n = streams * batches
    return {"batches": n, "cpu_s_per_1k": 1000 * cpu / n, "batches_per_s": n / wall}


async def _flat(variant: Any, streams: int, batches: int) -> dict[str, float]:
    ids = [f"f{secrets.token_hex(5)}" for _ in range(streams)]
    t0 = time.perf_counter()
    for i in range(batches):
        for sid in ids:
            await variant.publish(sid, *_batch(sid, i))
        await asyncio.sleep(0)
    await variant.flush()
    n = streams * batches
    return {"batches": n, "batches_per_s": n / (time.perf_counter() - t0)}


async def _first(variant: Any, bus: Bus, count: int) -> dict[str, float]:
    lat: list[float] = []
    for _ in range(count):
        sid = f"t{secrets.token_hex(5)}"
        got: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def on(msg: Msg, got: asyncio.Future[float] = got) -> None:
            if not got.done():
                got.set_result(time.perf_counter())

        sub = await bus.nc.subscribe(variant.live(sid), cb=on)
        await bus.nc.flush()
        t0 = time.perf_counter()
        await variant.publish(sid, *_batch(sid, 0))
        lat.append(1000 * (await asyncio.wait_for(got, 10) - t0))
        await sub.unsubscribe()
    await variant.flush()
    lat.sort()
    return {"p50_ms": statistics.median(lat), "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenpipe_cli.natsserver import NatsServer

    with tempfile.TemporaryDirectory(prefix="tokenpipe-appends-") as tmp, NatsServer(Path(tmp)) as server:
        bus = await connect(Settings.load(env={}, nats_url=server.url), name="bench-appends")
        try:
            out: dict[str, Any] = {}
            # Interleaved, twice, so that drift over the run (other load) falls on both alike.
            for rnd in range(2):
                for name, make in (("unconditional", Unconditional), ("conditional", Conditional)):
                    v = make(bus)
                    await v.start()
                    res = out.setdefault(name, {"paced": [], "flat": [], "first": []})
                    res["paced"].append(await _paced(v, args.streams, args.batches, args.rate))
                    res["flat"].append(await _flat(v, args.streams, args.batches))
                    res["first"].append(await _first(v, bus, args.first))
                    print(f"round {rnd} {name}: {res['paced'][-1]} {res['flat'][-1]} {res['first'][-1]}")
        finally:
            await bus.close()
    return out


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def summarize(out: dict[str, Any]) -> dict[str, float]:
    u, c = out["unconditional"], out["conditional"]
    return {
        "paced_cpu_s_per_1k_unconditional": _mean(u["paced"], "cpu_s_per_1k"),
        "paced_cpu_s_per_1k_conditional": _mean(c["paced"], "cpu_s_per_1k"),
        "paced_cpu_ratio": _mean(c["paced"], "cpu_s_per_1k") / _mean(u["paced"], "cpu_s_per_1k"),
        "flat_batches_per_s_unconditional": _mean(u["flat"], "batches_per_s"),
        "flat_batches_per_s_conditional": _mean(c["flat"], "batches_per_s"),
        "flat_ratio": _mean(c["flat"], "batches_per_s") / _mean(u["flat"], "batches_per_s"),
        "first_p50_ms_unconditional": _mean(u["first"], "p50_ms"),
        "first_p50_ms_conditional": _mean(c["first"], "p50_ms"),
        "first_p50_added_ms": _mean(c["first"], "p50_ms") - _mean(u["first"], "p50_ms"),
        "first_p99_ms_conditional": _mean(c["first"], "p99_ms"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="batches per stream (paced and flat out)")
    parser.add_argument("--rate", type=float, default=50.0, help="batches per second per stream when paced")
    parser.add_argument("--first", type=int, default=200, help="new streams timed for the first batch")
    parser.add_argument("--out", default="bench/out/appends.json")
    args = parser.parse_args(argv)
    out = asyncio.run(run(args))
    summary = summarize(out)
    print("\n| figure | unconditional | conditional | ratio / added |\n|---|---|---|---|")
    print(f"| CPU s per 1k batches, {args.streams} streams x {args.rate:g}/s | "
          f"{summary['paced_cpu_s_per_1k_unconditional']:.3f} | {summary['paced_cpu_s_per_1k_conditional']:.3f} | "
          f"x{summary['paced_cpu_ratio']:.2f} |")
    print(f"| batches/s flat out, {args.streams} streams | {summary['flat_batches_per_s_unconditional']:.0f} | "
          f"{summary['flat_batches_per_s_conditional']:.0f} | x{summary['flat_ratio']:.2f} |")
    print(f"| first batch to a live reader, p50 ms | {summary['first_p50_ms_unconditional']:.3f} | "
          f"{summary['first_p50_ms_conditional']:.3f} | +{summary['first_p50_added_ms']:.3f} ms |")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "runs": out, "summary": summary,
                                "cpu": platform.processor() or platform.machine()}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
