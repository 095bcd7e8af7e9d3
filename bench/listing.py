"""What the stream inspector's listing and its index cost (README "The stream inspector").

    python -m bench.listing [--tenants 10] [--sizes 100,1000,4000] [--rounds 200] [--out bench/out/listing.json]

On a fresh nats-server: ``--tenants`` tenants each get up to ``size`` indexed streams (the index
entries :func:`tokenpipe.streams.submit` writes, synthetic requests); then, per size,

- listing one tenant from its index (``streamindex.list_entries``: one subject-filtered
  ``STREAM.INFO``), and a tenant that keeps 100 streams throughout, against reading every key
  of the bucket (``KeyValue.keys()``, as ``tokenpipe streams`` did: a consumer over every
  tenant's entries, names only), median of 9 each;
- the submission round trip with and without the index write (``streams.submit`` into the work
  queue, no generator), alternating the two per request, ``--rounds`` each.

Prints a table and writes JSON. Absolute figures depend on the machine; read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tokenpipe import streamindex, streams
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe.wire import Request
from tokenpipe_cli.natsserver import NatsServer

PROMPT = "Tell me a very long story about message queues. " * 4


async def _median_ms(op: Callable[[], Awaitable[Any]], n: int = 9) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


async def _fill(bus: Bus, tenants: int, have: int, size: int) -> None:
    pending = [Request.create("bench", prompt=PROMPT, tenant=f"tenant-{t}")
               for _ in range(have, size) for t in range(tenants)]
    for start in range(0, len(pending), 256):
        await asyncio.gather(*(streamindex.record(bus, r) for r in pending[start:start + 256]))
    print(f"  indexed {size} streams for each of {tenants} tenants", flush=True)


async def _all_keys(bus: Bus) -> int:
    return len([k for k in await bus.meta.keys() if k.startswith("ix.")])


async def _submit_ms(bus: Bus, rounds: int) -> dict[str, float]:
    """Per-request submit latency, with the index write and without it, alternating."""
    real = streams.streamindex.record
    out: dict[str, list[float]] = {"with index": [], "without index": []}

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    try:
        for i in range(2 * rounds):
            variant = "with index" if i % 2 == 0 else "without index"
            streams.streamindex.record = real if variant == "with index" else nothing  # type: ignore[assignment]
            request = Request.create("bench", prompt=PROMPT, tenant="submitter")
            t0 = time.perf_counter()
            await streams.submit(bus, request)
            out[variant].append((time.perf_counter() - t0) * 1e3)
    finally:
        streams.streamindex.record = real  # type: ignore[assignment]
    return {f"{k} p50": statistics.median(v) for k, v in out.items()} | {
        f"{k} p99": sorted(v)[int(0.99 * (len(v) - 1))] for k, v in out.items()}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as nats:
        settings = Settings.load(env={}, nats_url=nats.url, data_dir=tmp)
        bus = await connect(settings, name="bench-listing")
        rows: list[dict[str, Any]] = []
        try:
            small = [Request.create("bench", prompt=PROMPT, tenant="small") for _ in range(100)]
            await asyncio.gather(*(streamindex.record(bus, r) for r in small))
            have = 0
            for size in sizes:
                await _fill(bus, args.tenants, have, size)
                have = size
                listed = len(await streamindex.list_entries(bus, "tenant-0"))
                assert listed == size, (listed, size)
                one = await _median_ms(lambda: streamindex.list_entries(bus, "tenant-0"))
                few = await _median_ms(lambda: streamindex.list_entries(bus, "small"))
                scan = await _median_ms(lambda: _all_keys(bus), n=3)
                rows.append({"streams per tenant": size, "entries in bucket": size * args.tenants + len(small),
                             "list one tenant (ms)": round(one, 2), "list a 100-stream tenant (ms)": round(few, 2),
                             "read every key (ms)": round(scan, 2), "ratio": round(scan / one, 1)})
            submit = await _submit_ms(bus, args.rounds)
        finally:
            await bus.close()
    return {"tenants": args.tenants, "listing": rows, "submit_ms": {k: round(v, 3) for k, v in submit.items()}}


def _print(result: dict[str, Any]) -> None:
    rows = result["listing"]
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    print("submit (ms): " + ", ".join(f"{k} {v}" for k, v in result["submit_ms"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--sizes", default="100,1000,4000")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default="bench/out/listing.json")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    _print(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
