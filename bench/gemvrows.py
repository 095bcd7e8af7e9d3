"""The one-row projection kernels' own speed: the library's ``gemv`` at one row, weights from cache and from memory.

    python -m bench.gemvrows [--rounds 5] [--cached-mb 8] [--streamed-mb 256] [--data-dir D]
                             [--out bench/out/gemvrows.json]

A one-stream decode step is one row of x against every projection's weights. Whether the kernel's
arithmetic or the memory bus sets its pace depends on the CPU: on a 2-vCPU cloud slice the weights
come from DRAM at 15-20 GB/s and a kernel that computes 25 GB/s waits for them; where memory is faster
per core (or the weights sit in a large L3) the kernel's own speed is the step's. This bench times
both, with synthetic weights of the shapes of the default model's projections (SmolLM2-135M: K = 576
for qkv, o, gate_up and the int8 lm_head, K = 1536 for down):

- ``cached``: one weight of about ``--cached-mb``, called again and again (it stays in L2/L3): the
  kernel's arithmetic;
- ``streamed``: copies of it adding up to ``--streamed-mb``, called in turn (more than an L3 holds):
  the arithmetic under the memory bus.

GB/s counts the bytes a call reads (weights and their scales). Each shape's result is first checked
against the dequantized weight's product. Compare builds by running it from two
checkouts in the same minutes (the machine may be shared: only ratios within one run mean anything).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from generator.kernels.build import load_gemv
from generator.kernels.formats import Q4Weight, Q8Weight, pack_q4, pack_q8
from generator.kernels.ops import GemvLib
from generator.model.loader import resolve_threads
from tokenpipe.settings import Settings

from .common import cpu_summary, write_json

__all__ = ["main"]

SHAPES = (("int4", 576, "qkv, o, gate_up"), ("int4", 1536, "down"), ("int8", 576, "lm_head"))


def _weight(kind: str, k: int, n: int, gen: torch.Generator) -> Q4Weight | Q8Weight:
    if kind == "int8":
        return pack_q8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen))
    g = k // 32
    return pack_q4(torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, g, generator=gen) * 1e-2,
                   torch.rand(n, g, generator=gen) * 1e-2)


def _dense(w: Q4Weight | Q8Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, Q4Weight) else w.q.float() * w.s[:, None]


def _nbytes(w: Q4Weight | Q8Weight) -> int:
    return sum(t.numel() * t.element_size() for t in vars(w).values())


def _gb_s(lib: GemvLib, x: torch.Tensor, weights: list[Q4Weight | Q8Weight], calls: int) -> float:
    lib.run(x, weights[0])
    t0 = time.perf_counter()
    for i in range(calls):
        lib.run(x, weights[i % len(weights)])
    return calls * _nbytes(weights[0]) / (time.perf_counter() - t0) / 1e9


def measure(lib: GemvLib, kind: str, k: int, rounds: int, cached_mb: float, streamed_mb: float) -> dict[str, Any]:
    """Median GB/s of ``rounds`` rounds, cached and streamed, alternated in each round."""
    gen = torch.Generator().manual_seed(k)
    per_row = k if kind == "int8" else k // 2 + k // 32 * 8
    n = max(16, int(cached_mb * 1e6 / per_row) // 16 * 16)
    cached = [_weight(kind, k, n, gen)]
    streamed = cached + [Q8Weight(w.q.clone(), w.s.clone()) if isinstance(w, Q8Weight) else
                         Q4Weight(w.nibbles.clone(), w.d.clone(), w.m.clone())
                         for w in cached * max(1, int(streamed_mb / cached_mb) - 1)]
    x = torch.randn(1, k, dtype=torch.bfloat16, generator=gen)
    ref = x.float() @ _dense(cached[0]).T
    err = float((lib.run(x, cached[0]).float() - ref).norm() / ref.norm())
    if err > 1e-2:  # bf16 output rounding is ~4e-3 of a value
        raise RuntimeError(f"{kind} K={k}: the kernel's product is off by {err:.2e} of the reference's norm")
    calls = max(8, int(64 * 8 / cached_mb))
    hot, cold = [], []
    for _ in range(rounds):
        hot.append(_gb_s(lib, x, cached, calls))
        cold.append(_gb_s(lib, x, streamed, len(streamed)))
    return {"kind": kind, "k": k, "n": n, "mb": _nbytes(cached[0]) / 1e6, "rel_err": err,
            "cached_gb_s": statistics.median(hot), "streamed_gb_s": statistics.median(cold),
            "cached_rounds": hot, "streamed_rounds": cold}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cached-mb", type=float, default=8.0, help="the cached weight's size")
    ap.add_argument("--streamed-mb", type=float, default=256.0, help="the streamed copies' total size")
    ap.add_argument("--data-dir", default=None, help="where the library is built (default: TOKENPIPE_DATA_DIR)")
    ap.add_argument("--out", default="bench/out/gemvrows.json")
    args = ap.parse_args(argv)
    settings = Settings.load(**({"data_dir": args.data_dir} if args.data_dir else {}))
    torch.set_num_threads(resolve_threads(settings.threads))
    cpu = cpu_summary()
    print(f"bench.gemvrows: {cpu['line']}; {torch.get_num_threads()} threads; torch {torch.__version__} "
          "(the machine may be shared: compare ratios)", flush=True)
    lib = load_gemv(settings.data_dir)
    if lib is None:
        print("the kernel library does not build here (the log says why): nothing to measure")
        return 1
    rows = []
    for kind, k, roles in SHAPES:
        print(f"measuring {kind} K={k} ({roles}) ...", flush=True)
        rows.append({**measure(lib, kind, k, args.rounds, args.cached_mb, args.streamed_mb), "roles": roles})
    print(f"\n{'weights':>8} {'K':>5} {'N':>6} {'MB':>6} {'cached GB/s':>12} {'streamed GB/s':>14}  roles")
    for r in rows:
        print(f"{r['kind']:>8} {r['k']:>5} {r['n']:>6} {r['mb']:>6.1f} {r['cached_gb_s']:>12.1f} "
              f"{r['streamed_gb_s']:>14.1f}  {r['roles']}")
    out = Path(args.out)
    write_json(out, {"cpu": cpu, "threads": torch.get_num_threads(), "library": lib.path.name,
                     "rounds": args.rounds, "shapes": rows}, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
