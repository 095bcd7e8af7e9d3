"""Kernels chosen by measurement: the table on this CPU, its start-up cost, and decode steps against the rules.

    python -m bench.kernels [--rows 1,8,16,32] [--rounds 8] [--steps 4] [--threads N]

Loads the default model as a generator does (``TOKENPIPE_DTYPE``/``TOKENPIPE_QUANT``, ``auto``: bf16
and int4 on an AVX512-BF16 CPU), then on this thread: measures the kernel table into an empty data
dir (the start-up cost of a first start), reads it back (a second start), prints each projection's
candidate times and the chosen bands, and times whole decode steps (context 104, as bench.quant) at
each ``--rows`` under the measured table and under today's hand rules, alternating per round (the
order reversed every other round); it reports medians and the median per-round ratio. The machine
may be shared: only the ratios within one run mean anything. JSON: ``bench/out/kernels.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from generator.model.attention import FP32_ATTENTION_ROWS
from generator.model.autotune import BUSY_SHARE, OthersLoad, apply_table, tune_plan
from generator.model.kerneltable import KERNEL_CHOICES, ROLES, KernelTable, kernel_for, row_counts, rule_table
from generator.model.loader import load_model, resolve_threads
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear, dense_rows_for
from tokenpipe.logs import setup_logging
from tokenpipe.settings import Settings

from .common import alternate, cpu_summary, write_json
from .kvstep import RawSteps

console = Console(width=170)
CONTEXT = 104


def _decode_rounds(lm: Any, tables: dict[str, KernelTable], rows: int, steps: int,
                   rounds: int) -> dict[str, list[float]]:
    plan = plan_for(lm.model)
    attend = -(-(CONTEXT + steps * rounds + 8) // 32) * 32
    raw = RawSteps(lm, rows, attend)
    ids = torch.randint(100, 40_000, (rows, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        tok = raw.prefill(ids).argmax(-1)
    pos = CONTEXT
    out: dict[str, list[float]] = {k: [] for k in tables}
    items = list(tables.items())
    for r in range(-1, rounds):  # round -1 warms up each variant
        for name, table in alternate(items, r):
            apply_table(plan, table, keep_packed=True)
            t0 = time.perf_counter()
            for _ in range(steps):
                raw.decode(tok, torch.full((rows,), pos), attend)
                pos = min(pos + 1, attend - 1)
            if r >= 0:
                out[name].append((time.perf_counter() - t0) / steps * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/out/kernels.json")
    args = ap.parse_args(argv)
    s = Settings.load()
    torch.set_num_threads(resolve_threads(args.threads or s.threads))
    cpu = cpu_summary()
    console.print(f"[bold]bench.kernels[/]: {cpu['line']}; {torch.get_num_threads()} threads; torch {torch.__version__}"
                  " (the machine may be shared: compare ratios)")
    lm = load_model(s.model, path=s.model_path, device="cpu", dtype=s.dtype, quant=s.quant, data_dir=s.data_dir,
                    kernels="rules", max_batch=s.max_batch)
    plan = plan_for(lm.model)
    dense_rows = dense_rows_for(lm.dtype, native_bf16=lm.dtype == torch.bfloat16)
    counts = row_counts(s.max_batch)
    lib = next((m.gemv_lib for m in plan.projections("o") if isinstance(m, QuantLinear)), None)
    rules = rule_table(counts, dense_rows, quantized=lm.quant != "none", attention_fp32_rows=FP32_ATTENTION_ROWS,
                       level=lib.level if lib is not None else "")  # the rules a generator here starts with
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        load = OthersLoad()  # reported, not judged: the benchmark shows what it measured either way
        measured = tune_plan(lm.model, plan, name=lm.name, dtype=lm.dtype, dense_rows=dense_rows,
                             max_batch=s.max_batch, data_dir=tmp, busy_share=None)
        first_s = time.monotonic() - t0
        others = load.share()
        t0 = time.monotonic()
        cached = tune_plan(lm.model, plan, name=lm.name, dtype=lm.dtype, dense_rows=dense_rows,
                           max_batch=s.max_batch, data_dir=tmp)
        second_s = time.monotonic() - t0
    # the rules' projections against the measured ones, attention alike on both sides
    rules = replace(rules, paged_attention_rows=measured.paged_attention_rows)
    console.print(f"start-up: measuring {first_s:.1f} s ({measured.source}); second start {second_s * 1e3:.0f} ms "
                  f"({cached.source})")
    if others is not None:
        note = " [bold red]above the generator's limit: it would not trust this table[/]" if others > BUSY_SHARE else ""
        console.print(f"other processes used {others:.0%} of the CPUs while it measured{note}")
    t = Table(title=f"{lm.name} {lm.quant} {str(lm.dtype).removeprefix('torch.')}: µs per call (chosen *)")
    t.add_column("role")
    t.add_column("rows", justify="right")
    for k in KERNEL_CHOICES:
        t.add_column(k, justify="right")
    t.add_column("rule")
    for role in ROLES:
        for count, times in measured.times_us[role].items():
            chosen = kernel_for(measured.bands[role], int(count))
            t.add_row(role, count, *(f"{times[k]:.0f}{' *' if k == chosen else ''}" if k in times else "-"
                                    for k in KERNEL_CHOICES), kernel_for(rules.bands[role], int(count)))
    console.print(t)
    console.print(f"measured: {measured.summary()}")
    console.print(f"rules:    {rules.summary()}")
    steps: dict[str, Any] = {}
    st = Table(title="decode step ms (median of rounds; ratio = rules ÷ measured per round, >1: measured faster)")
    for col in ("rows", "rules", "measured", "ratio", "ratio range"):
        st.add_column(col, justify="right")
    for rows in (int(r) for r in args.rows.split(",")):
        console.print(f"[dim]decode steps at {rows} rows[/]")
        res = _decode_rounds(lm, {"rules": rules, "measured": measured}, rows, int(args.steps), int(args.rounds))
        ratios = [a / b for a, b in zip(res["rules"], res["measured"], strict=True)]
        steps[str(rows)] = {"rules_ms": statistics.median(res["rules"]),
                            "measured_ms": statistics.median(res["measured"]),
                            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                            "rounds": res}
        g = steps[str(rows)]
        st.add_row(str(rows), f"{g['rules_ms']:.1f}", f"{g['measured_ms']:.1f}", f"{g['ratio']:.2f}x",
                   f"{g['ratio_min']:.2f}-{g['ratio_max']:.2f}")
    console.print(st)
    apply_table(plan, measured)
    result = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "model": lm.name,
              "quant": lm.quant, "dtype": str(lm.dtype), "startup_s": first_s, "cached_startup_s": second_s,
              "others_share": others,
              "table": {"bands": measured.bands, "attention_fp32_rows": measured.attention_fp32_rows,
                        "paged_attention_rows": measured.paged_attention_rows,
                        "times_us": measured.times_us, "steps_ms": measured.steps_ms},
              "rules": {"bands": rules.bands, "attention_fp32_rows": rules.attention_fp32_rows},
              "decode": steps}
    out = Path(args.out)
    write_json(out, result, indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    setup_logging("bench", Settings.load().log_level)  # the table's progress and result lines
    raise SystemExit(main())
