"""`make bench`: the whole pipeline against the raw batched forward ceiling, in one run.

    python -m bench.pipeline [--streams 32] [--max-tokens 128] [--out bench/out/pipeline.json]
    python -m bench.pipeline --only ttft --model tiny-random [--ttft-requests 200]
    python -m bench.pipeline --only ttft --model tiny-random --bus open,accounts,open,accounts

Runs, in order: in-process reference points (raw forward step at the stream count, fp32 and
bf16; our engine; HF generate one at a time; the naive no-KV-cache loop), then starts a real
nats-server, a generator process and a relay process and drives them over HTTP/SSE:
TTFT at one stream (pipeline-added = client TTFT minus the engine's own prefill time, per
request, from the batch timestamps) and aggregate tokens/s at ``--streams`` concurrent
streams. Every comparison is a ratio within this run. ``--only ttft`` runs just the TTFT phase
(no in-process engine, no concurrent streams) and prints where the first batch's time went;
``--bus`` runs it on an open bus and/or under tokenpipe's NATS accounts (``tokenpipe up``'s
authorization: the relay in its own account, each owner's intake stream), one pipeline per entry in
the order given, and compares them as a ratio (each bus's requests pooled).

The phases live in :mod:`bench.reference` (in-process), :mod:`bench.stack` (the processes),
:mod:`bench.drive` (over HTTP), :mod:`bench.pipeline_results` (the figures) and
:mod:`bench.pipeline_report` (the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from generator.model.loader import load_model, resolve_threads
from tokenpipe.settings import Settings

from .common import write_json
from .drive import Record, Runs, drive, drive_ttft
from .pipeline_report import render, render_ttft
from .pipeline_results import goals, pipeline_figures, ratios, stage_breakdown, ttft_figures
from .reference import engine_again, measure_engine
from .stack import Pipeline


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="engine dtype: auto, bfloat16, float16 or float32")
    parser.add_argument("--quant", default="auto", help="weight-only quantization: auto, none, int8, int4 "
                                                        "(the in-process engine and the generator alike)")
    parser.add_argument("--engine-batches", type=lambda v: [int(x) for x in v.split(",")], default=[8, 32, 64],
                        help="stream counts for the engine-vs-ceiling sweep (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--cuda-graphs", default=Settings.load().cuda_graphs, choices=["auto", "on", "off"],
                        help="the in-process engine's decode step captured as CUDA graphs (default: "
                             "TOKENPIPE_CUDA_GRAPHS, which the generator reads too)")
    parser.add_argument("--max-seq-len", type=int, default=Settings.load().max_seq_len,
                        help="the in-process engine's and the generator's (TOKENPIPE_MAX_SEQ_LEN)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the concurrent-streams phase (mean)")
    parser.add_argument("--baseline-tokens", type=int, default=32)
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--out", default="bench/out/pipeline.json")
    parser.add_argument("--only", choices=["ttft"], default=None,
                        help="just one phase: 'ttft' = the pipeline's TTFT at one stream and its stages")
    parser.add_argument("--bus", type=_buses, default=["open"],
                        help="with --only ttft: open and/or accounts, comma-separated, one pipeline each in this "
                             "order (repeat them to alternate); the first named is the baseline")
    parser.add_argument("--gen-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the generator and relay processes (repeatable)")
    return parser.parse_args(argv)


def _buses(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in ("open", "accounts") for n in names):
        raise argparse.ArgumentTypeError(f"--bus takes open and/or accounts, comma-separated, not {value!r}")
    return names


def measure(args: argparse.Namespace, console: Console) -> tuple[dict[str, Any], Runs]:
    """The engine in-process, the pipeline over HTTP, then the engine again."""
    with Progress(console=console, transient=False) as progress:
        # The in-process engine gets the generator's threads, weights and kernel table (the same setting and
        # max batch: the same cached table), so pipeline ÷ engine compares like with like. Until part 10 of
        # issue 21 it kept the hand rules while the generator measured its table.
        settings = Settings.load()
        torch.set_num_threads(resolve_threads(settings.threads))
        lm = load_model(args.model, device=args.device, dtype=args.dtype, quant=args.quant, data_dir=args.data_dir,
                        kernels=settings.kernels, max_batch=max(args.streams, 1))
        eng = measure_engine(lm, args, progress)
        # The generator takes every stream at once, as the in-process engine does: with the default
        # max batch (32) a 64-stream run queued half its requests behind the other half.
        extra_env = {"TOKENPIPE_QUANT": args.quant, "TOKENPIPE_MAX_BATCH": str(max(args.streams, 1)),
                     "TOKENPIPE_MAX_SEQ_LEN": str(args.max_seq_len),
                     **dict(kv.split("=", 1) for kv in args.gen_env)}
        with Pipeline(args.model, args.data_dir, extra_env, args.device, args.dtype) as pipe:
            runs = asyncio.run(drive(pipe.url, args, progress))
        engine_again(lm, eng, args)
        del lm
        gc.collect()
    return eng, runs


def measure_ttft(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """``--only ttft``: the pipeline's TTFT at one stream and its stages, on each bus of ``--bus``
    (the first one's are the headline figures); no in-process engine."""
    pooled: dict[str, tuple[list[Record], list[Record]]] = {}
    with Progress(console=console, transient=False) as progress:
        extra_env = {"TOKENPIPE_QUANT": args.quant, **dict(kv.split("=", 1) for kv in args.gen_env)}
        for bus in args.bus:
            accounts = bus == "accounts"
            with Pipeline(args.model, args.data_dir, extra_env, args.device, args.dtype, auth=accounts) as pipe:
                singles, singles_httpx = asyncio.run(drive_ttft(pipe.url, args, progress))
            mine = pooled.setdefault(bus, ([], []))
            mine[0].extend(singles)
            mine[1].extend(singles_httpx)
    first = pooled[args.bus[0]][0]
    out: dict[str, Any] = {"pipeline": ttft_figures(*pooled[args.bus[0]]),
                           "stages_1_stream_p50_ms": stage_breakdown(first),
                           "stages_1_stream_p99_ms": stage_breakdown(first, 99)}
    if len(pooled) > 1:
        figures = {bus: ttft_figures(*records) for bus, records in pooled.items()}
        out["buses"] = {bus: {**f, "stages_1_stream_p50_ms": stage_breakdown(pooled[bus][0])}
                        for bus, f in figures.items()}
        base = figures[args.bus[0]]
        out["bus_ratios"] = {bus: {k: f[k] / base[k] for k in ("ttft_1_stream_p50_ms", "added_ttft_p50_ms",
                                                               "added_ttft_p99_ms") if base[k] > 0}
                             for bus, f in figures.items() if bus != args.bus[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    if args.only == "ttft":
        results.update(measure_ttft(args, console))
        render_ttft(results, console)
        _write(results, args.out, console)
        return 0
    eng, runs = measure(args, console)
    pipe = pipeline_figures(runs, eng, args.streams, args.max_tokens)
    results["engine"] = eng
    results["pipeline"] = pipe
    results["stages_32_streams_p50_ms"] = stage_breakdown([r for batch, _ in runs.rounds for r in batch])
    results["stages_1_stream_p50_ms"] = stage_breakdown(runs.singles)
    results["ratios"] = ratios(pipe, eng)
    results["goals"] = goals(pipe, results["ratios"], eng)
    render(results, console)
    _write(results, args.out, console)
    return 0 if pipe["all_finished"] else 1


def _write(results: dict[str, Any], path: str, console: Console) -> None:
    out = Path(path)
    write_json(out, results, indent=2)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
