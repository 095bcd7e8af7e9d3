"""Rich tables for benchmark summaries."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["summary_table"]


def summary_table(s: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                       ("e2e_ms", "E2E (ms)"), ("inter_batch_ms", "inter-batch (ms)")):
        row = s[key]
        t.add_row(label, *(f"{row[c]:.1f}" for c in ("mean", "p50", "p90", "p99")))
    t.caption = (f"{s['succeeded']}/{s['requests']} ok in {s['wall_s']:.1f}s · {s['request_throughput']:.2f} req/s · "
                 f"{s['output_tok_s']:.1f} output tok/s · {s['tokens_per_batch']:.2f} tokens/batch")
    return t
