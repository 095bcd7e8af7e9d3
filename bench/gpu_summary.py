"""The summary table of ``bench/gpu.sh``: one row per model from ``bench.pipeline``'s JSON files.

    python -m bench.gpu_summary bench/out/gpu-*.json [--out bench/out/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import write_json

__all__ = ["summarize"]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        eng, pipe, ratio = r["engine"], r["pipeline"], r["ratios"]
        rows.append({
            "model": r["config"]["model"], "streams": r["config"]["streams"], "dtype": eng["engine_dtype"],
            "ceiling_tok_s": eng["ceiling_tok_s"], "engine_tok_s": eng["engine_tok_s"], "pipeline_tok_s": pipe["tok_s"],
            "engine_vs_ceiling": ratio["engine_vs_ceiling"], "pipeline_vs_ceiling": ratio["pipeline_vs_ceiling"],
            "pipeline_vs_engine": ratio["pipeline_vs_engine"],
            "engine_ttft_p50_ms": eng["engine_ttft_p50_ms"], "ttft_p50_ms": pipe["ttft_1_stream_p50_ms"],
            "ttft_p99_ms": pipe["ttft_1_stream_p99_ms"], "added_ttft_p50_ms": pipe["added_ttft_p50_ms"],
            "sweep": {n: row["ratio"] for n, row in eng["engine_sweep"].items()},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", default="bench/out/gpu.json")
    args = parser.parse_args(argv)
    present = [Path(f) for f in args.files if Path(f).exists()]
    rows = summarize([json.loads(p.read_text()) for p in present])
    for row, p in zip(rows, present, strict=True):
        row["run"] = p.stem.removeprefix("gpu-")  # gpu.sh's before/after runs of one model
    table = Table(title="GPU: engine and full pipeline vs the raw batched forward ceiling")
    for col in ("run", "streams", "ceiling tok/s", "engine tok/s", "pipeline tok/s", "engine ×", "pipeline ×",
                "pipeline/engine", "engine/raw step at " + "/".join(rows[0]["sweep"]) if rows else "sweep",
                "TTFT p50 engine / pipeline ms", "added p50 ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["run"], str(r["streams"]), f"{r['ceiling_tok_s']:,.0f}", f"{r['engine_tok_s']:,.0f}",
                      f"{r['pipeline_tok_s']:,.0f}", f"{r['engine_vs_ceiling']:.2f}", f"{r['pipeline_vs_ceiling']:.2f}",
                      f"{r['pipeline_vs_engine']:.2f}", " / ".join(f"{v:.2f}" for v in r["sweep"].values()),
                      f"{r['engine_ttft_p50_ms']:.1f} / {r['ttft_p50_ms']:.1f}", f"{r['added_ttft_p50_ms']:.1f}")
    Console(width=200).print(table)
    out = Path(args.out)
    write_json(out, rows, indent=1)
    missing = sorted(set(args.files) - {str(p) for p in present})
    if missing:
        print(f"missing (a run failed or timed out): {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
