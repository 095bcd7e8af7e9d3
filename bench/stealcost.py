"""What a neighbour's CPU bursts cost the engine at one stream: the in-process engine, quiet and beside a
process that works in bursts, alternated in one run.

    python -m bench.stealcost [--bursts 50/416,150/1250,600/5000,1200/10000] [--rounds 3]
                              [--max-tokens 256] [--model smollm2-135m] [--gil] [--out bench/out/stealcost.json]

Each burst is ``on/period`` in microseconds: a child process spins for ``on`` µs, then sleeps for the
rest of ``period`` (the pattern of the pipeline's I/O: the generator's event loop, the relay, nats-server
and the client each wake briefly a few times a token). The engine decodes one greedy stream of
``--max-tokens`` tokens on its own thread (all torch work there, as in the generator), with the
generator's threads, weights and kernel table; each round times it quiet, then beside each burst
pattern. ``--gil`` adds the same bursts on a thread of the engine's own process, where they also hold
the GIL (the generator's event loop does).

On a machine whose cores the engine's OpenMP team holds, a burst takes a core from the team mid-step
and the step waits for it at the region's barrier: the loss is compared with the bursts' duty (their
share of one core) in the table (bench/RESULTS.md, "issue 21, part 16").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from generator.model.loader import load_model, resolve_threads
from tokenpipe.settings import Settings

from . import ceilings
from .ceilings import cpu_summary
from .reference import prompt_ids

__all__ = ["main"]


def _burst(on_us: float, period_us: float) -> None:
    end = time.perf_counter() + on_us / 1e6
    while time.perf_counter() < end:
        pass
    time.sleep(max(0.0, (period_us - on_us) / 1e6))


def _neighbour(pattern: Any, go: Any, stop: Any) -> None:
    """The child process: bursts of ``pattern`` (on, period) while ``go`` is set, blocked otherwise."""
    while not stop.is_set():
        if go.wait(0.1):
            _burst(pattern[0], pattern[1])


class EngineThread:
    """The engine on its own thread: every torch call there (the generator's rule, generator.runner.torch_thread)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._jobs: queue.Queue[bool] = queue.Queue()
        self._results: queue.Queue[float | BaseException] = queue.Queue()
        self._args = args
        threading.Thread(target=self._run, daemon=True, name="engine").start()

    def _run(self) -> None:
        try:
            settings = Settings.load()
            torch.set_num_threads(resolve_threads(settings.threads))
            lm = load_model(self._args.model, device="cpu", dtype=settings.dtype, quant=settings.quant,
                            data_dir=self._args.data_dir, kernels=settings.kernels, max_batch=1)
            prompts = prompt_ids(lm, 1)
        except BaseException as exc:  # reported by the first decode() instead of a hung queue
            self._results.put(exc)
            return
        while self._jobs.get():
            self._results.put(ceilings.engine_tok_s(lm, prompts, self._args.max_tokens, max_batch=1).tok_s)

    def decode(self, while_waiting: tuple[float, float] | None = None) -> float:
        """One stream's tokens/s; ``while_waiting`` bursts on this (the caller's) thread meanwhile."""
        self._jobs.put(True)
        while while_waiting is not None and self._results.empty():
            _burst(*while_waiting)
        res = self._results.get()
        if isinstance(res, BaseException):
            raise res
        return res

    def close(self) -> None:
        self._jobs.put(False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    bursts = {b: tuple(float(v) for v in b.split("/")) for b in args.bursts.split(",")}  # "on/period": (on, period)
    ctx = mp.get_context("fork")
    pattern, go, stop = ctx.Array("d", [0.0, 0.0]), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_neighbour, args=(pattern, go, stop), daemon=True)
    child.start()
    engine = EngineThread(args)
    tok_s: dict[str, list[float]] = {}
    duty = {"quiet": 0.0}
    try:
        engine.decode()  # warm-up
        for r in range(args.rounds):
            tok_s.setdefault("quiet", []).append(engine.decode())
            for name, (on, period) in bursts.items():
                pattern[0], pattern[1] = on, period
                go.set()
                tok_s.setdefault(name, []).append(engine.decode())
                go.clear()
                duty[name] = duty[f"{name} gil"] = on / period
                if args.gil:
                    tok_s.setdefault(f"{name} gil", []).append(engine.decode((on, period)))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tok_s.items()),
                  flush=True)
    finally:
        engine.close()
        go.clear()
        stop.set()
        child.join(timeout=5)
    quiet = statistics.median(tok_s["quiet"])
    rows = [{"bursts": name, "duty": duty[name], "tok_s": statistics.median(values), "runs": values,
             "vs_quiet": statistics.median(values) / quiet} for name, values in tok_s.items()]
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bursts", default="50/416,150/1250,600/5000,1200/10000",
                        help="on/period in µs, comma-separated (the same 12 %% duty by default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--gil", action="store_true", help="also burst on a thread of the engine's process")
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--out", default="bench/out/stealcost.json")
    args = parser.parse_args(argv)
    cpu = cpu_summary()
    print(f"{cpu['line']}; one stream of {args.max_tokens} tokens, {args.rounds} rounds", flush=True)
    result = run(args)
    print("\n| bursts (on/period µs) | duty (one core) | tok/s (median) | ÷ quiet |\n|---|---:|---:|---:|")
    for row in result["rows"]:
        print(f"| {row['bursts']} | {row['duty']:.0%} | {row['tok_s']:.1f} | {row['vs_quiet']:.3f} |")
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": vars(args), "cpu": cpu, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
