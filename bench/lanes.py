"""A person's chat behind an offline backlog: interactive TTFT idle, and behind a backlog created at
the default tier (the one FIFO of before classes of service), as batch work (``flex``), or as a
Batch API batch of ``--batch-lines`` lines (``POST /v1/files`` + ``/v1/batches``), in one run; two
applications on the bus, one submitting ``--bus-jobs`` jobs (fair share between owners); and batch
work alone against the default tier's throughput (:mod:`bench.batchrate`, scenario ``rate``).

    python -m bench.lanes [--model tiny-random] [--backlog 16] [--backlog-tokens 256] [--batch-lines N] [--cases C,...]
                          [--max-batch 16] [--rounds 3] [--scenarios http,bus,rate] [--bus-jobs 200]
                          [--bus-tokens 64] [--weights other=2] [--window 10] [--rate-streams 32]
                          [--rate-tokens 128] [--out bench/out/lanes.json]

A whole pipeline (nats-server, one generator process with ``--max-batch`` slots, the relay; see
:mod:`bench.stack`). The backlog's streams are created through ``POST /v1/streams`` and not read,
as an offline job does; then one interactive chat is read over SSE and its TTFT taken from the
POST. The batch case waits until the relay's runner has its lines in flight (the inspector lists
them). The backlog is cancelled before the next measurement. The cases alternate by round.

On the bus (:mod:`bench.fairbus`): application ``other``'s short request alone, and behind
application ``flood``'s jobs, its TTFT from its publish to its first batch; then both
applications backlogged (``other`` queued behind ``flood``), each one's tokens over ``--window``
seconds against its weighted share (``TOKENPIPE_OWNER_WEIGHTS`` = ``--weights``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from tokenpipe.settings import Settings

from .batchrate import print_rate, rate_scenario
from .common import alternate, chat, write_json
from .fairbus import bus_scenario, print_bus
from .rawhttp import raw_stream
from .stack import Pipeline

__all__ = ["main"]

CASES = ("idle", "behind-default", "behind-flex", "behind-batch", "behind-other-tenant")
# API keys of the run: an application's (every backlog) and a person's. The chat is the
# application's own except in ``behind-other-tenant``, where the person's chat meets the
# application's default-tier backlog (fair share between tenants).
APP_KEY, PERSON_KEY = "bench-app-key", "bench-person-key"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--backlog", type=int, default=16, help="streams created ahead of the chat")
    parser.add_argument("--backlog-tokens", type=int, default=256, help="max_tokens of each backlog stream")
    parser.add_argument("--batch-lines", type=int, default=None,
                        help="lines of the Batch API batch ahead of the chat (default: --backlog)")
    parser.add_argument("--chat-tokens", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (idle always runs: the ratios' base)")
    parser.add_argument("--max-batch", type=int, default=16, help="the generator's slots (TOKENPIPE_MAX_BATCH)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--scenarios", default="http,bus,rate",
                        help="comma-separated: http (the lanes), bus (fair share), rate (batch work alone)")
    parser.add_argument("--bus-jobs", type=int, default=200, help="jobs application `flood` submits on the bus")
    parser.add_argument("--bus-tokens", type=int, default=64, help="max_tokens of each of its jobs")
    parser.add_argument("--weights", default="other=2", help="TOKENPIPE_OWNER_WEIGHTS for the run")
    parser.add_argument("--window", type=float, default=10.0, help="seconds both applications' tokens are counted")
    parser.add_argument("--rate-streams", type=int, default=32, help="streams (and batch lines) of the rate part")
    parser.add_argument("--rate-tokens", type=int, default=128, help="max_tokens of each of them")
    parser.add_argument("--out", default="bench/out/lanes.json")
    args = parser.parse_args(argv)
    if args.batch_lines is None:
        args.batch_lines = args.backlog
    cases = {c.strip() for c in args.cases.split(",") if c.strip()} | {"idle"}
    if cases - set(CASES):
        parser.error(f"--cases: unknown {', '.join(sorted(cases - set(CASES)))}; of {', '.join(CASES)}")
    args.cases = tuple(c for c in CASES if c in cases)
    return args


async def _case(url: str, case: str, args: argparse.Namespace, n: int) -> float:
    """The chat's TTFT in ms for one case; its backlog cancelled after."""
    base = {"temperature": 0, "ignore_eos": True}
    ids: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {APP_KEY}"}) as client:
        if case == "behind-batch":
            return await _behind_batch(client, url, args, n, base)
        if case != "idle":
            tier = "default" if case == "behind-other-tenant" else case.removeprefix("behind-")
            for i in range(args.backlog):
                r = await client.post("/v1/streams", json={"messages": chat(100 + i), **base, "service_tier": tier,
                                                            "max_tokens": args.backlog_tokens})
                r.raise_for_status()
                ids.append(r.json()["id"])
        rec = await raw_stream(url, {"messages": chat(n), **base, "max_tokens": args.chat_tokens},
                               PERSON_KEY if case == "behind-other-tenant" else APP_KEY)
        for sid in ids:
            await client.delete(f"/v1/streams/{sid}")
        for sid in ids:  # read to its end: its slot is free once its last batch is stored
            await client.get(f"/v1/streams/{sid}", params={"cancel_on_disconnect": "false"})
    if not rec.ok:
        raise RuntimeError(f"the chat failed: {rec.error}")
    return rec.ttft * 1000


async def _behind_batch(client: httpx.AsyncClient, url: str, args: argparse.Namespace, n: int,
                        base: dict[str, Any]) -> float:
    lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": chat(100 + i), **base, "max_tokens": args.backlog_tokens}}) + "\n"
                    for i in range(args.batch_lines))
    f = await client.post("/v1/files", files={"file": ("backlog.jsonl", lines.encode())}, data={"purpose": "batch"})
    f.raise_for_status()
    b = await client.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
    b.raise_for_status()
    batch_id = b.json()["id"]
    in_flight = min(args.batch_lines, Settings.load().batch_concurrency)
    while len((await client.get("/v1/streams", params={"batch": batch_id, "limit": 100})).json()["data"]) < in_flight:
        await asyncio.sleep(0.05)  # polling the inspector until the runner's lines are all submitted
    rec = await raw_stream(url, {"messages": chat(n), **base, "max_tokens": args.chat_tokens}, APP_KEY)
    await client.post(f"/v1/batches/{batch_id}/cancel")
    while (await client.get(f"/v1/batches/{batch_id}")).json()["status"] not in ("cancelled", "completed"):
        await asyncio.sleep(0.05)  # its lines in flight are cancelled and the batch closed
    if not rec.ok:
        raise RuntimeError(f"the chat failed: {rec.error}")
    return rec.ttft * 1000


async def _measure(url: str, args: argparse.Namespace, console: Console) -> dict[str, list[float]]:
    await raw_stream(url, {"messages": chat(999), "max_tokens": 4}, APP_KEY)  # warm-up
    samples: dict[str, list[float]] = {c: [] for c in args.cases}
    for r in range(args.rounds):
        for case in alternate(args.cases, r):
            samples[case].append(await _case(url, case, args, r))
            console.print(f"  round {r + 1} {case}: {samples[case][-1]:.1f} ms")
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    load = os.getloadavg()
    env = {"TOKENPIPE_MAX_BATCH": str(args.max_batch), "TOKENPIPE_KERNELS": "rules",
           "TOKENPIPE_OWNER_WEIGHTS": args.weights, "TOKENPIPE_API_KEYS": f"{APP_KEY}:app,{PERSON_KEY}:person",
           "TOKENPIPE_MAX_STREAMS_PER_KEY": str(max(64, 2 * args.backlog, 2 * args.rate_streams)),
           "TOKENPIPE_BATCH_CONCURRENCY": str(max(Settings.load().batch_concurrency, args.rate_streams))}
    scenarios = {s.strip() for s in args.scenarios.split(",")}
    samples: dict[str, list[float]] = {}
    bus: dict[str, Any] = {}
    rate: dict[str, Any] = {}
    with Pipeline(args.model, args.data_dir, extra_env=env, device=args.device, dtype=args.dtype,
                  ready_timeout=900) as p:
        if "http" in scenarios:
            samples = asyncio.run(_measure(p.url, args, console))
        if "bus" in scenarios:
            bus = asyncio.run(bus_scenario(p.nats.url, args, console))
        if "rate" in scenarios:
            rate = asyncio.run(rate_scenario(p.url, args, APP_KEY, console))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_before": load,
                    "load_after": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    if samples:
        medians = {c: statistics.median(v) for c, v in samples.items()}
        results |= {"ttft_ms_median": medians, "over_idle": {c: medians[c] / medians["idle"] for c in args.cases},
                    "samples_ms": samples}
        table = Table(title=f"chat TTFT behind {args.backlog} x {args.backlog_tokens}-token streams "
                            f"({args.batch_lines} batch lines), "
                            f"{args.max_batch} slots ({args.model})")
        for col in ("case", "TTFT p50 ms", "x idle"):
            table.add_column(col, justify="left" if col == "case" else "right")
        for c in args.cases:
            table.add_row(c, f"{medians[c]:.1f}", f"{results['over_idle'][c]:.1f}")
        console.print(table)
    if bus:
        results["bus"] = bus
        print_bus(bus, args, console)
    if rate:
        results["rate"] = rate
        print_rate(rate, args, console)
    out = write_json(Path(args.out), results)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
