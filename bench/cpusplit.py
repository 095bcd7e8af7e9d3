"""Where a token's CPU goes through the whole pipeline: each process and thread, per token, from /proc.

    python -m bench.cpusplit [--streams 8] [--max-tokens 256] [--model smollm2-135m]
                             [--out bench/out/cpusplit.json]

Starts the pipeline as :mod:`bench.pipeline` does (a nats-server, one generator process, one relay
process), sends one warm-up stream, then ``--streams`` greedy chat streams of ``--max-tokens`` tokens
*one after another* (one stream at a time: issue 21's whole-stack-against-engine case) with the
minimal HTTP client, and reads every thread's user and system CPU time and context switches
(voluntary and not) before and after. Per token: the generator's event loop (its main thread), its
engine threads (the engine thread and its OpenMP team), the relay, nats-server and this client.

On a 2-core machine the engine's thread team holds both cores through a step, so the rest of the
pipeline's CPU is time taken from a step: its sum per token against the step is about what the
whole stack loses against the in-process engine (bench/RESULTS.md, "issue 21, part 16").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from generator.model.loader import resolve_threads
from tokenpipe.settings import Settings

from .ceilings import cpu_summary
from .procstat import ThreadTimes, thread_times
from .rawhttp import raw_stream
from .stack import Pipeline
from .workload import chat

__all__ = ["main"]


async def _streams(url: str, n: int, max_tokens: int) -> int:
    tokens = 0
    for i in range(n):
        rec = await raw_stream(url, {"messages": chat(i), "max_tokens": max_tokens, "temperature": 0,
                                     "ignore_eos": True})
        if not rec.ok:
            raise RuntimeError(f"stream {i} ended with {rec.finish!r}: {rec.error}")
        tokens += rec.tokens
    return tokens


def _client() -> ThreadTimes:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return ThreadTimes(r.ru_utime, r.ru_stime, r.ru_nvcsw + r.ru_nivcsw)


def _delta(a: ThreadTimes, b: ThreadTimes, tokens: int) -> dict[str, float]:
    """Per token: CPU ms (user, system, both) and context switches."""
    user, sys_ = (b.user_s - a.user_s) * 1e3 / tokens, (b.sys_s - a.sys_s) * 1e3 / tokens
    return {"cpu_ms": user + sys_, "user_ms": user, "sys_ms": sys_, "switches": (b.switches - a.switches) / tokens}


def _sum(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) for k in ("cpu_ms", "user_ms", "sys_ms", "switches")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with Pipeline(args.model, args.data_dir) as pipe:
        assert pipe.generator is not None and pipe.relay is not None
        assert pipe.nats.pid is not None
        pids = {"generator": pipe.generator.pid, "relay": pipe.relay.pid, "nats-server": pipe.nats.pid}
        asyncio.run(_streams(pipe.url, 1, args.max_tokens))  # warm-up: the first stream pays one-off costs
        before = {name: thread_times(pid) for name, pid in pids.items()}
        client0, t0 = _client(), time.perf_counter()
        tokens = asyncio.run(_streams(pipe.url, args.streams, args.max_tokens))
        wall, client1 = time.perf_counter() - t0, _client()
        after = {name: thread_times(pid) for name, pid in pids.items()}
    rows: dict[str, dict[str, float]] = {}
    for name, threads in after.items():
        per = {tid: _delta(before[name][tid], t, tokens) for tid, t in threads.items() if tid in before[name]}
        if name == "generator":
            loop = per.pop(pids["generator"])  # the main thread runs the event loop
            busy = sorted(per.values(), key=lambda r: -r["cpu_ms"])
            team = resolve_threads(Settings.load().threads)  # the engine thread and its OpenMP team, the busiest
            rows["generator: event loop"] = loop
            rows["generator: engine threads"] = _sum(busy[:team])
            rows["generator: other threads"] = _sum(busy[team:])
        else:
            rows[name] = _sum(list(per.values()))
    rows["client (this process)"] = _delta(client0, client1, tokens)
    outside = _sum([r for name, r in rows.items() if name != "generator: engine threads"])
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ms_per_token": wall * 1e3 / tokens,
            "rows": rows, "outside_engine": outside}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=8, help="streams, one after another")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--out", default="bench/out/cpusplit.json")
    args = parser.parse_args(argv)
    cpu = cpu_summary()
    print(f"{cpu['line']}; {args.streams} streams x {args.max_tokens} tokens, one at a time", flush=True)
    result = measure(args)
    table = Table(title=f"CPU per token through the pipeline ({result['tok_s']:.1f} tok/s, "
                        f"{result['ms_per_token']:.2f} ms a token)")
    for col in ("where", "CPU ms/token", "user", "system", "switches/token"):
        table.add_column(col, justify="left" if col == "where" else "right")
    for name, r in [*result["rows"].items(), ("everything but the engine threads", result["outside_engine"])]:
        table.add_row(name, f"{r['cpu_ms']:.3f}", f"{r['user_ms']:.3f}", f"{r['sys_ms']:.3f}", f"{r['switches']:.2f}")
    Console().print(table)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": vars(args), "cpu": cpu, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
