"""The engine thread against the engine-core process (``TOKENPIPE_ENGINE_PROCESS``), in one run.

    python -m bench.enginecore [--models tiny-random,smollm2-135m] [--streams 1,32] [--max-tokens 64]
                               [--rounds 2] [--out bench/out/enginecore.json]

For each model, a whole pipeline (nats-server, one generator process, the relay; see
:mod:`bench.stack`) runs with the engine as a thread of the generator (``off``) and as its own
process (``on``), the two alternating ``--rounds`` times (off, on, on, off, …) so that both see
the same machine. Each measures, over HTTP/SSE with the minimal client: tokens/s at each stream
count (one stream: requests one after another; N: N at once) and the pipeline-added TTFT at one
stream (client TTFT minus the engine's own prefill). The table gives process ÷ thread per figure;
this is what ``auto`` is chosen by (docs/perf-history.md, issue 22).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenpipe.settings import Settings

from .common import alternate, chat, pct, write_json
from .pipeline_results import added_ms
from .rawhttp import raw_stream
from .stack import Pipeline

__all__ = ["main"]

MODES = ("off", "on")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda v: v.split(","), default=["tiny-random", "smollm2-135m"])
    parser.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--singles", type=int, default=8, help="one-stream requests per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="off/on alternations per model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--out", default="bench/out/enginecore.json")
    return parser.parse_args(argv)


async def _measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    await raw_stream(url, {"messages": chat(999), **base, "max_tokens": 8})  # warm-up
    out: dict[str, float] = {}
    for streams in args.streams:
        if streams == 1:
            t0, tokens, recs = time.perf_counter(), 0, []
            for i in range(args.singles):
                rec = await raw_stream(url, {"messages": chat(i), **base})
                recs.append(rec)
                tokens += rec.tokens
            out["tok_s_1"] = tokens / (time.perf_counter() - t0)
            out["added_ttft_p50_ms"] = pct(added_ms(recs), 50)
            continue
        await asyncio.gather(*(raw_stream(url, {"messages": chat(i), **base, "max_tokens": 4})
                               for i in range(streams)))  # the batch shapes once, as the engine sweeps do
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(raw_stream(url, {"messages": chat(i), **base}) for i in range(streams)))
        out[f"tok_s_{streams}"] = sum(r.tokens for r in recs) / (time.perf_counter() - t0)
        if not all(r.finish == "length" for r in recs):
            raise RuntimeError(f"a stream did not finish: {[r.error for r in recs if r.finish != 'length']}")
    return out


def measure(args: argparse.Namespace, console: Console, results: dict[str, Any],
            save: Callable[[], None]) -> None:
    """Into ``results`` by model, saved after each model (a later model's failure keeps the rest)."""
    for model in args.models:
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in alternate(MODES, r):
                console.print(f"{model}: engine process {mode} (round {r + 1}/{args.rounds})")
                # The kernel rules: both arms the same kernels, and no start-up measuring on a busy machine.
                env = {"TOKENPIPE_ENGINE_PROCESS": mode, "TOKENPIPE_KERNELS": "rules"}
                with Pipeline(model, args.data_dir, extra_env=env, device=args.device, dtype=args.dtype,
                              ready_timeout=900) as p:
                    samples[mode].append(asyncio.run(_measure(p.url, args)))
                console.print(f"  {', '.join(f'{k} {v:.1f}' for k, v in samples[mode][-1].items())}")
        per_mode = {m: {k: statistics.mean(s[k] for s in samples[m]) for k in samples[m][0]} for m in MODES}
        ratio = {k: per_mode["on"][k] / per_mode["off"][k] for k in per_mode["off"]}
        results[model] = {"thread": per_mode["off"], "process": per_mode["on"], "process_over_thread": ratio,
                          "samples": samples}
        save()


def render(results: dict[str, Any], console: Console) -> None:
    table = Table(title="engine thread vs engine-core process (process ÷ thread)")
    for col in ("model", "figure", "thread", "process", "ratio"):
        table.add_column(col, justify="left" if col in ("model", "figure") else "right")
    for model, r in results["models"].items():
        for key, ratio in r["process_over_thread"].items():
            table.add_row(model, key, f"{r['thread'][key]:.1f}", f"{r['process'][key]:.1f}", f"{ratio:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    load = os.getloadavg()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_before": load},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    results["models"] = {}
    out = Path(args.out)

    def save() -> None:
        results["machine"]["load_after"] = os.getloadavg()
        write_json(out, results)

    measure(args, console, results["models"], save)
    render(results, console)
    console.print(f"wrote {out}  (load before {load[0]:.2f}, after {results['machine']['load_after'][0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
