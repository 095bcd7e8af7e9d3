"""Where a decode step's time goes: the projections against the rest, and the bandwidth share at one row.

    python -m bench.stepsplit [--rows 1,32] [--rounds 7] [--steps 16] [--label NAME] [--model M]
                              [--out bench/out/stepsplit.json]

Loads the default model as a generator does (``TOKENPIPE_DTYPE``/``TOKENPIPE_QUANT``/``TOKENPIPE_KERNELS``),
fills a context of 104 (as bench.kernels) and, per row count, alternates two timings each round:
whole decode steps (``generator.model.forward.decode_step``), and the same steps with every projection
(qkv, o, gate_up, down per layer, lm_head) swapped for a stub that returns zeros of its output's
shape: *the rest* — norms, RoPE, attention over the KV cache, residuals, the cache write and
Python dispatch. The projections' part is the difference, and with it each projection's call
(dispatch, its output's allocation): the rest is a
lower bound: a stubbed projection makes no call at all. (Timing the projections alone in a
loop and subtracting instead overstated the rest by ~40 %: back to back they run faster than
between the other ops.) Where the decoder layers run as one call (generator/model/stack.py), the stubbed step is
that call with every projection writing zeros, and a third timing each round, the same step op by op,
gives what the one call saves (``stack x``). At one row it also reports the bytes of weights a step reads
(the kernel each projection runs at that row count) against this machine's read bandwidth
(a 1 GiB fp32 sum on the engine's threads): the share of the ceiling the step reaches.

Another checkout is timed by copying this file into it and running ``python -m bench.stepsplit
--label before`` there (run by its path, ``bench/`` comes first on ``sys.path`` and its
``kernels.py`` shadows the ``kernels`` package transformers looks for): the way a change to the
forward pass is compared, rounds of the two alternated by the caller. The machine may be
shared: only ratios mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import write_json
from bench.kvstep import RawSteps, add_model_args, load_as_generator
from generator.model.kerneltable import kernel_for
from generator.model.loader import LoadedModel
from generator.model.plan import Plan, plan_for
from generator.model.quant import QuantLinear

CONTEXT = 104


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_bytes(mod: nn.Module, rows: int) -> int:
    """What one call of ``mod`` on ``rows`` rows reads of its weight (the kernel it runs there)."""
    if isinstance(mod, QuantLinear):
        kernel = kernel_for(mod.bands, rows)
        if kernel == "packed" and mod.packed is not None:
            return _bytes(mod.packed)
        if kernel == "gemv" and mod.gemv is not None and mod.gemv_lib is not None:
            return sum(_bytes(t) for t in vars(mod.gemv).values())
        if kernel in ("gemm8", "amx") and mod.blocked is not None:
            return sum(_bytes(t) for t in vars(mod.blocked).values() if isinstance(t, torch.Tensor))
        if kernel in ("gemv", "gemm8", "amx"):
            kernel = "quant"  # QuantLinear.run's stand-in where gemv is not built
        if kernel != "quant" or mod.fallback:
            return _bytes(mod.dense)
        return _bytes(mod.qweight) + _bytes(mod.scales)
    return sum(_bytes(p) for p in mod.parameters())


def read_gb_s(gib: float = 1.0, rounds: int = 5) -> float:
    """Read bandwidth on this process's threads: the best of ``rounds`` sums over ``gib`` of fp32."""
    x = torch.ones(int(gib * 2**30 / 4))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return _bytes(x) / best / 1e9


class _Zeros(nn.Module):
    """A projection's stand-in: zeros of its output's shape (what the rest is timed with)."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)


@contextmanager
def projections_stubbed(plan: Plan, hidden: int, vocab: int) -> Iterator[None]:
    """Within: every projection of ``plan`` returns zeros (see :class:`_Zeros`)."""
    saved = [(lp.qkv, lp.o, lp.gate_up, lp.down) for lp in plan.layers], plan.lm_head
    for lp in plan.layers:
        lp.qkv, lp.o = _Zeros(lp.q_size + 2 * lp.kv_size), _Zeros(hidden)
        lp.gate_up, lp.down = _Zeros(2 * lp.inter), _Zeros(hidden)
    plan.lm_head = _Zeros(vocab)
    # the layers in one call (generator/model/stack.py): its projections write zeros (getattr: a checkout before the
    # stack is timed with this file too)
    stack = getattr(plan, "stack", None)
    if stack is not None:
        stack.projections_off = True
    try:
        yield
    finally:
        if stack is not None:
            stack.projections_off = False
        for lp, (qkv, o, gate_up, down) in zip(plan.layers, saved[0], strict=True):
            lp.qkv, lp.o, lp.gate_up, lp.down = qkv, o, gate_up, down
        plan.lm_head = saved[1]


def split(lm: LoadedModel, rows: int, rounds: int, steps: int) -> dict[str, Any]:
    raw = RawSteps(lm, rows, CONTEXT + steps + 1)
    raw.prefill(torch.randint(0, 1000, (rows, CONTEXT)))
    tokens = torch.randint(0, 1000, (rows,))
    plan, cfg = plan_for(lm.model), lm.model.config
    step_ms: list[float] = []
    rest_ms: list[float] = []

    def steps_ms() -> float:
        t0 = time.perf_counter()
        for i in range(steps):
            raw.decode(tokens, torch.full((rows,), CONTEXT + i), CONTEXT + i + 1)
        return (time.perf_counter() - t0) / steps * 1e3

    stack = getattr(plan, "stack", None)
    op_by_op_ms: list[float] = []
    for r in range(-1, rounds):  # round -1 warms both up
        step = steps_ms()
        with projections_stubbed(plan, int(cfg.hidden_size), int(cfg.vocab_size)):
            rest = steps_ms()
        if stack is not None:  # the same step without generator/model/stack.py, alternated: what the stack saves
            plan.stack = None
            try:
                op_by_op = steps_ms()
            finally:
                plan.stack = stack
        if r >= 0:
            step_ms.append(step)
            rest_ms.append(rest)
            if stack is not None:
                op_by_op_ms.append(op_by_op)
    step, rest = statistics.median(step_ms), statistics.median(rest_ms)
    return {"rows": rows, "step_ms": step, "projections_ms": step - rest, "rest_ms": rest,
            "rest_share": rest / step, "tok_s": rows * 1e3 / step, "step_rounds_ms": step_ms,
            "rest_rounds_ms": rest_ms, "op_by_op_ms": statistics.median(op_by_op_ms) if op_by_op_ms else None,
            "op_by_op_rounds_ms": op_by_op_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--label", default="")
    add_model_args(ap)
    ap.add_argument("--out", default="bench/out/stepsplit.json")
    args = ap.parse_args(argv)
    lm, cpu = load_as_generator(args, "bench.stepsplit")
    plan = plan_for(lm.model)
    print(f"{lm.name} {lm.quant} {str(lm.dtype).removeprefix('torch.')}", flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'rows':>5} {'step ms':>9} {'proj ms':>9} {'rest ms':>9} {'rest %':>7} {'tok/s':>8} {'op-by-op ms':>12} "
          f"{'stack x':>8}")
    for rows in rows_list:
        res = split(lm, rows, args.rounds, args.steps)
        results.append(res)
        obo = res["op_by_op_ms"]
        print(f"{rows:>5} {res['step_ms']:>9.2f} {res['projections_ms']:>9.2f} {res['rest_ms']:>9.2f} "
              f"{res['rest_share'] * 100:>6.0f}% {res['tok_s']:>8.1f} "
              + (f"{obo:>12.2f} {obo / res['step_ms']:>7.2f}x" if obo else f"{'-':>12} {'-':>8}"), flush=True)
    mods = [m for lp in plan.layers for m in (lp.qkv, lp.o, lp.gate_up, lp.down)] + [plan.lm_head]
    per_token = sum(weight_bytes(m, 1) for m in mods)
    bw = read_gb_s()
    one = next((r for r in results if r["rows"] == 1), None)
    share = None
    if one is not None:
        share = per_token / (one["step_ms"] / 1e3) / 1e9 / bw
        print(f"one row: {per_token / 1e6:.1f} MB of weights per step; read bandwidth {bw:.1f} GB/s "
              f"(ceiling {bw * 1e9 / per_token:.0f} tok/s); the step reaches {share * 100:.0f}% of it")
    out = Path(args.out)
    write_json(out, {"label": args.label, "cpu": cpu,
                     "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "model": lm.name, "quant": lm.quant,
                     "dtype": str(lm.dtype), "context": CONTEXT, "splits": results,
                     "weight_bytes_per_token": per_token, "read_gb_s": bw,
                     "bandwidth_share_one_row": share}, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
