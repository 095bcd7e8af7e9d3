"""What ``TOKENPIPE_FLOAT_WEIGHTS=drop`` costs a prefill and saves in memory: the model loaded as a generator
loads it, once keeping the quantized projections' float weights and once without them (each float weight
made for a matmul beyond the kernel table's quantized rows), one prompt's prefill timed at each length,
alternated by round.

    python -m bench.floatweights [--lengths 64,128,512,1024] [--rounds 5] [--out bench/out/floatweights.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import OUT_DIR, alternate, cpu_summary, rss_kib, write_json
from bench.kvstep import RawSteps
from generator.model.loader import LoadedModel, load_model, resolve_threads
from tokenpipe.settings import Settings

__all__ = ["main"]

VARIANTS = ("keep", "drop")


def _load(s: Settings, float_weights: str) -> tuple[LoadedModel, float]:
    """The model as a generator loads it, and what its load added to this process's RSS (MB)."""
    gc.collect()
    before = _rss_mb()
    lm = load_model(s.model, path=s.model_path, device="cpu", dtype=s.dtype, quant=s.quant, data_dir=s.data_dir,
                    kernels=s.kernels, max_batch=s.max_batch, float_weights=float_weights)
    return lm, _rss_mb() - before


def _rss_mb() -> float:
    return rss_kib(os.getpid()) / 1024


def _prefill_ms(raw: RawSteps, length: int, reps: int = 3) -> float:
    ids = torch.randint(100, 40_000, (1, length))
    raw.prefill(ids)  # warm: the first call of a shape allocates
    start = time.perf_counter()
    for _ in range(reps):
        raw.prefill(ids)
    return (time.perf_counter() - start) / reps * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,128,512,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(OUT_DIR / "floatweights.json"))
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    s = Settings.load()
    torch.set_num_threads(resolve_threads(s.threads))
    console = Console()
    cpu = cpu_summary()
    console.print(f"bench.floatweights: {cpu['line']}; {torch.get_num_threads()} threads; {s.model}")
    loads: dict[str, LoadedModel] = {}
    added: dict[str, float] = {}
    for v in VARIANTS:
        loads[v], added[v] = _load(s, v)
        console.print(f"  loaded with float weights {v}: +{added[v]:.0f} MB RSS")
    raws = {v: RawSteps(lm, 1, max(lengths) + 16) for v, lm in loads.items()}
    samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in lengths} for v in VARIANTS}
    for r in range(args.rounds):
        for v in alternate(VARIANTS, r):
            for n in lengths:
                samples[v][n].append(_prefill_ms(raws[v], n))
        console.print(f"  round {r + 1}/{args.rounds} done")
    med = {v: {n: statistics.median(samples[v][n]) for n in lengths} for v in VARIANTS}
    table = Table(title=f"one prompt's prefill, float weights kept or dropped ({s.model}, p50 of {args.rounds})")
    for col in ("tokens", "keep ms", "drop ms", "drop / keep"):
        table.add_column(col, justify="right")
    for n in lengths:
        keep, drop = med["keep"][n], med["drop"][n]
        table.add_row(str(n), f"{keep:.1f}", f"{drop:.1f}", f"{drop / keep:.2f}")
    console.print(table)
    results: dict[str, Any] = {"cpu": cpu, "model": s.model, "threads": torch.get_num_threads(),
                               "load_rss_added_mb": added, "prefill_ms_median": med,
                               "drop_over_keep": {n: med["drop"][n] / med["keep"][n] for n in lengths},
                               "samples_ms": samples}
    console.print(f"wrote {write_json(args.out, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
