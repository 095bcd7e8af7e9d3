"""How a load run is shown: a rich summary table, latency CDFs as a PNG."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from .loadgen import Record

__all__ = ["plot", "summary_table"]


def summary_table(s: dict[str, Any], title: str) -> Table:
    """The summary of :func:`tokenpipe_cli.stats.summarize` as a table."""
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


def plot(records: list[Record], path: str, title: str) -> None:
    """Latency CDFs (TTFT, ITL, E2E) as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft * 1e3 for r in ok], "E2E": [r.e2e * 1e3 for r in ok],
              "ITL": [(c - p) / n * 1e3 for r in ok
                      for p, c, n in zip(r.arrivals, r.arrivals[1:], r.batch_tokens[1:], strict=False) if n]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, vals) in zip(axes, series.items(), strict=True):
        vals = sorted(vals)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / tokens")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
