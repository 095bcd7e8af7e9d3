"""Two applications on the bus, one submitting a backlog: fair share between owners (bench.lanes' bus part).

Application ``flood`` publishes ``--bus-jobs`` jobs of ``--bus-tokens`` tokens; application ``other``
then publishes one short request, whose TTFT (publish to first batch) is compared with the same
request on an idle generator. Then both applications are backlogged, ``other``'s jobs queued behind
``flood``'s, and each one's tokens over ``--window`` seconds (by the batches' emission times, read
back from the token store) are compared with its weighted share.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from producer import Producer
from producer.client import StreamHandle
from tokenpipe.quota import parse_weights, weight_of
from tokenpipe.settings import Settings
from tokenpipe.streams import history_at

from .common import alternate

__all__ = ["bus_scenario", "print_bus"]

APPS = ("flood", "other")
BUS_CASES = ("idle", "behind-flood")
_SETTLE_S = 2.0  # after both backlogs are queued, before tokens are counted: the shares settle


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 400 + 3 for j in range(24)]


async def _ttft(other: Producer, model: str, n: int, tokens: int) -> float:
    """``other``'s short request: ms from its publish to its first batch with tokens."""
    started = time.perf_counter()
    handle = await other.submit(model, input_ids=_prompt(10_000 + n), max_tokens=tokens, temperature=0,
                                ignore_eos=True)
    async for batch in handle:
        if batch.token_ids or batch.is_final:
            ttft = (time.perf_counter() - started) * 1000
            break
    await handle.result()
    return ttft


async def _flood(app: Producer, model: str, jobs: int, tokens: int, start: int = 0) -> list[StreamHandle]:
    return [await app.submit(model, input_ids=_prompt(start + i), max_tokens=tokens, temperature=0, ignore_eos=True)
            for i in range(jobs)]


async def _drain(handles: list[StreamHandle]) -> None:
    """Cancel them and wait until each stream ended (the generator's slots are free again)."""
    for h in handles:
        await h.cancel()
    await asyncio.gather(*(h.producer.stream(h.id).result() for h in handles), return_exceptions=True)


async def _shares(apps: dict[str, Producer], model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both backlogged: each application's tokens within the window, and whether each still had
    requests not yet started when it closed (backlogged throughout)."""
    handles = {name: await _flood(apps[name], model, args.bus_jobs, args.bus_tokens, start=1000 * k)
               for k, name in enumerate(APPS)}
    await asyncio.sleep(_SETTLE_S)  # a measurement window, not synchronisation
    t0 = time.time_ns()
    await asyncio.sleep(args.window)
    t1 = time.time_ns()
    for hs in handles.values():
        await _drain(hs)
    tokens = dict.fromkeys(APPS, 0)
    unstarted = dict.fromkeys(APPS, 0)
    for name, hs in handles.items():
        for h in hs:
            batches, _ = await history_at(apps[name].bus, h.id, owner=name)
            emitted = [b.timings.get("emitted", 0) for b in batches if b.token_ids]
            tokens[name] += sum(len(b.token_ids) for b in batches if b.token_ids and t0 <= b.timings.get(
                "emitted", 0) <= t1)
            unstarted[name] += not emitted or min(emitted) > t1
    weights = parse_weights(args.weights)
    total_w = sum(weight_of(weights, a) for a in APPS)
    total = sum(tokens.values()) or 1
    return {"window_s": args.window, "tokens": tokens, "unstarted_at_end": unstarted,
            "backlogged_throughout": all(unstarted[a] > 0 for a in APPS),
            "share": {a: tokens[a] / total for a in APPS},
            "weighted_share": {a: weight_of(weights, a) / total_w for a in APPS},
            "of_weighted_share": {a: tokens[a] / total / (weight_of(weights, a) / total_w) for a in APPS}}


async def bus_scenario(nats_url: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The bus scenario against the pipeline's nats-server (an open bus: each app names itself)."""
    settings = Settings.load(nats_url=nats_url)
    model = args.model
    apps = {a: await Producer.connect(settings=settings.replace(app_name=a)) for a in APPS}
    try:
        await _ttft(apps["other"], model, -1, args.chat_tokens)  # warm-up
        samples: dict[str, list[float]] = {c: [] for c in BUS_CASES}
        for r in range(args.rounds):
            for case in alternate(BUS_CASES, r):
                backlog = await _flood(apps["flood"], model, args.bus_jobs, args.bus_tokens) \
                    if case != "idle" else []
                samples[case].append(await _ttft(apps["other"], model, r, args.chat_tokens))
                await _drain(backlog)
                console.print(f"  bus round {r + 1} {case}: {samples[case][-1]:.1f} ms")
        medians = {c: statistics.median(v) for c, v in samples.items()}
        shares = await _shares(apps, model, args)
    finally:
        for app in apps.values():
            await app.close()
    return {"ttft_ms_median": medians, "over_idle": medians["behind-flood"] / medians["idle"],
            "samples_ms": samples, "shares": shares}


def print_bus(bus: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"bus: app `other` behind app `flood`'s {args.bus_jobs} x {args.bus_tokens}-token jobs, "
                        f"{args.max_batch} slots ({args.model}), weights {args.weights or 'equal'}")
    for col in ("measure", "value"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    medians = bus["ttft_ms_median"]
    table.add_row("TTFT p50 idle, ms", f"{medians['idle']:.1f}")
    table.add_row("TTFT p50 behind the flood, ms", f"{medians['behind-flood']:.1f}")
    table.add_row("x idle", f"{bus['over_idle']:.1f}")
    shares = bus["shares"]
    for app in APPS:
        table.add_row(f"{app}: tokens in {shares['window_s']:.0f} s (share / weighted share)",
                      f"{shares['tokens'][app]} ({shares['share'][app]:.2f} / {shares['weighted_share'][app]:.2f} "
                      f"= {shares['of_weighted_share'][app]:.2f}x)")
    table.add_row("both backlogged throughout", str(shares["backlogged_throughout"]))
    console.print(table)
