"""Engine throughput with a CPU-bound neighbour process, niced and not, against none.

    python -m bench.neighbour [--streams 32] [--threads 2,1] [--dtype auto] [--quant int4]

The in-process engine runs ``--streams`` greedy requests to completion (``--new-tokens``
each) under three conditions: no neighbour, one busy-loop process at ``nice 19``, one at
nice 0; and for each torch thread count in ``--threads``. Rounds alternate every condition
and thread count; each cell reports its median tok/s and its median per-round ratio to the
quiet run with the same thread count, and to the quiet run with the first thread count
(torch's default). The machine's other load is not controlled: only ratios within a run count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from generator.model.loader import load_model
from tokenpipe.settings import Settings

from .ceilings import cpu_summary, engine_tok_s

console = Console(width=160)
CONDITIONS = ("none", "nice 19", "nice 0")


def _neighbour(condition: str) -> subprocess.Popen[bytes] | None:
    if condition == "none":
        return None
    niceness = int(condition.split()[1])
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=(lambda: os.nice(niceness)) if niceness else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.neighbour")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", default=f"{torch.get_num_threads()},1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="bench/out/neighbour.json")
    args = ap.parse_args(argv)
    lm = load_model(args.model, device="cpu", dtype=args.dtype, quant=args.quant,
                    data_dir=args.data_dir or Settings.load().data_dir)
    prompts = [lm.tokenizer.encode(f"Write a short note about item number {i} in the list.")
               for i in range(args.streams)]
    threads = [int(t) for t in args.threads.split(",")]
    cpu = cpu_summary()
    console.print(f"[bold]bench.neighbour[/] · {cpu['line']} · {args.model} {lm.dtype} quant {lm.quant}")
    engine_tok_s(lm, prompts[:4], 4, args.streams)  # warm-up
    res: dict[tuple[str, int], list[float]] = {(c, t): [] for c in CONDITIONS for t in threads}
    for r in range(args.rounds):
        for cond in CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]:
            proc = _neighbour(cond)
            try:
                for t in threads if r % 2 == 0 else threads[::-1]:
                    torch.set_num_threads(t)
                    res[(cond, t)].append(engine_tok_s(lm, prompts, args.new_tokens, args.streams).tok_s)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    torch.set_num_threads(threads[0])
    table = Table(title=f"engine, {args.streams} streams, with a CPU-bound neighbour "
                        f"({args.rounds} alternating rounds)")
    for col in ("neighbour", "threads", "tok/s (median)", "range", "× quiet, same threads",
                f"× quiet, {threads[0]} threads"):
        table.add_column(col, justify="left" if col == "neighbour" else "right")
    out: list[dict[str, Any]] = []
    for (cond, t), values in res.items():
        same = statistics.median(v / q for v, q in zip(values, res[("none", t)], strict=True))
        first = statistics.median(v / q for v, q in zip(values, res[("none", threads[0])], strict=True))
        table.add_row(cond, str(t), f"{statistics.median(values):.1f}", f"{min(values):.1f}-{max(values):.1f}",
                      f"{same:.2f}", f"{first:.2f}")
        out.append({"neighbour": cond, "threads": t, "tok_s": values, "ratio_quiet_same_threads": same,
                    f"ratio_quiet_{threads[0]}_threads": first})
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu, "model": args.model, "dtype": str(lm.dtype), "quant": lm.quant,
                                          "streams": args.streams, "rows": out}, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
