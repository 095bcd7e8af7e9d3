"""What choosing the next token costs per decode step, by sampling mode and batch size.

    python -m bench.sampling [--rows 1,8,32] [--rounds 7] [--calls 50] [--label NAME] [--model M]
                             [--out bench/out/sampling.json]

Loads the default model as a generator does, prefills ``rows`` of the benchmark's chat prompts
(the longer ones shortened at their start to the shortest one's length, so each still ends where the reply
begins) and times :func:`generator.engine.sampling.sample` on the logits of the first token of the
reply, every row with the same parameters: greedy, temperature only (OpenAI's defaults: no top-k, top-p 1),
top-p 0.9 and top-k 50 (both at temperature 0.9). The modes alternate within each round; the
median of the rounds' means is reported, with the share of a decode step it costs: the engine's
own greedy step of that many rows (``generator.engine.Engine``, eager, on the same threads).
Another checkout is timed by copying this file into it and running ``python -m bench.sampling
--label before`` there (run by its path, ``bench/`` would come first on ``sys.path``, and its
``kernels.py`` would shadow the ``kernels`` package transformers looks for). The machine may be
shared: compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import write_json
from bench.kvstep import RawSteps, add_model_args, load_as_generator
from bench.reference import prompt_ids
from generator.engine.sampling import RowSampler, sample
from generator.engine.scheduler import Engine
from generator.model.loader import LoadedModel
from tokenpipe.wire import SamplingParams

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "temperature": {"temperature": 0.9},
    "top-p 0.9": {"temperature": 0.9, "top_p": 0.9},
    "top-k 50": {"temperature": 0.9, "top_k": 50},
}


def time_modes(logits: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """Median over ``rounds`` of the mean ms of ``calls`` samplings of ``logits`` per mode."""
    samplers = {m: [RowSampler.from_params(SamplingParams.from_map({**p, "seed": i}), logits.device)
                    for i in range(logits.shape[0])] for m, p in MODES.items()}
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(-1, rounds):  # round -1 warms up
        for mode in MODES:
            t0 = time.perf_counter()
            for _ in range(calls):
                sample(logits, samplers[mode])
            if r >= 0:
                per_mode[mode].append((time.perf_counter() - t0) / calls * 1e3)
    return {m: statistics.median(v) for m, v in per_mode.items()}


def engine_step_ms(lm: LoadedModel, prompts: list[list[int]], steps: int = 8) -> float:
    """Mean ms of the engine's greedy decode steps with one row per prompt (after two warm-up steps)."""
    eng = Engine(lm, max_batch=len(prompts), max_seq_len=max(map(len, prompts)) + steps + 4)
    params = SamplingParams.from_map({"max_tokens": steps + 3, "ignore_eos": True, "temperature": 0})
    for i, p in enumerate(prompts):
        eng.add(eng.new_sequence(f"bench-{i}", p, params))
    for _ in range(3):  # the prefill, then two steps' one-time costs
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--label", default="")
    add_model_args(ap)
    ap.add_argument("--out", default="bench/out/sampling.json")
    args = ap.parse_args(argv)
    lm, cpu = load_as_generator(args, "bench.sampling")
    print(f"{'rows':>5} {'step ms':>8} " + " ".join(f"{m + ' ms':>15} {'of step':>8}" for m in MODES), flush=True)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = prompt_ids(lm, rows)
        width = min(len(p) for p in prompts)
        raw = RawSteps(lm, rows, width + 1)
        logits = raw.prefill(torch.tensor([p[len(p) - width:] for p in prompts])).float()  # [rows, V]
        step_ms = engine_step_ms(lm, prompts)
        ms = time_modes(logits, args.rounds, args.calls)
        results.append({"rows": rows, "step_ms": step_ms, "sample_ms": ms})
        print(f"{rows:>5} {step_ms:>8.2f} " + " ".join(f"{v:>15.3f} {v / step_ms * 100:>7.1f}%" for v in ms.values()),
              flush=True)
    out = write_json(args.out, {"label": args.label, "cpu": cpu, "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "model": lm.name, "modes": MODES, "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
