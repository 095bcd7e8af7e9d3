"""What the single-writer rule costs the whole pipeline: tokens/s at 32 streams and TTFT, A/B in one run.

    python -m bench.fencecost [--streams 32] [--max-tokens 128] [--rounds 3] [--ttft-requests 30]
                              [--model smollm2-135m] [--b unconditional|no-hold] [--out bench/out/fencecost.json]

Each round starts a fresh pipeline (nats-server, one generator process, one relay process, as
:mod:`bench.pipeline` does) with one of two generators, alternated A B B A ...:

- ``conditional``: ``tokenpipe generator``, each append conditional on the stream's last stored
  batch, one in flight per stream, the live copy sent once stored (:mod:`generator.publisher`);
- ``unconditional``: the same process with the rule switched off (:mod:`bench.unfenced`);
- or, with ``--b no-hold``, ``tokenpipe generator`` whose engine does not pause for new
  streams' first batches (``TOKENPIPE_FIRST_BATCH_HOLD_MS=0``, :class:`generator.runner.FirstBatchGate`).

and drives it over HTTP with the minimal client: ``--ttft-requests`` single streams one after
another (the pipeline-added TTFT: client TTFT minus the engine's prefill, from the batch's own
stamps; and its last hop, the first batch from emitted by the generator to the client, where
the rule's wait for the store falls), then ``--streams`` concurrent streams of ``--max-tokens``
tokens (aggregate tokens/s, and the generator process's CPU seconds per 1,000 tokens, the
engine's included). Figures are means over a variant's rounds;
the comparison is the ratio conditional ÷ unconditional.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

from tokenpipe.append import EXPECTED_LAST
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe.subjects import TOKENS_STREAM

from .pipeline_results import STAGES, added_ms, pct, stage_breakdown
from .procstat import cpu_seconds
from .rawhttp import raw_stream
from .stack import Pipeline
from .workload import chat

__all__ = ["main"]

LAST_HOP = next(name for name, (a, _) in STAGES.items() if a == "emitted")  # the hop the rule adds to
VARIANTS = {"conditional": ("tokenpipe_cli", {}), "unconditional": ("bench.unfenced", {}),
            "no-hold": ("tokenpipe_cli", {"TOKENPIPE_FIRST_BATCH_HOLD_MS": "0"})}  # name: launcher, environment


async def _conditional(nats_url: str) -> bool:
    """Whether the first batch stored carries the single-writer condition (each variant is what it says)."""
    bus = await connect(Settings.load(env={}, nats_url=nats_url), name="bench-fencecost", provision_streams=False)
    try:
        msg = await bus.js.get_msg(TOKENS_STREAM, seq=1)
        return EXPECTED_LAST in (msg.headers or {})
    finally:
        await bus.close()


async def _round(url: str, nats_url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    base = {"temperature": 0, "ignore_eos": True}
    await raw_stream(url, {"messages": chat(999), **base, "max_tokens": 8})  # one-time costs
    await asyncio.gather(*(raw_stream(url, {"messages": chat(i), **base, "max_tokens": 4})
                           for i in range(args.streams)))  # the batch shapes, once
    singles = [await raw_stream(url, {"messages": chat(i), **base, "max_tokens": 4})
               for i in range(args.ttft_requests)]
    added = added_ms(singles)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    many = await asyncio.gather(*(raw_stream(url, {"messages": chat(i), **base, "max_tokens": args.max_tokens})
                                  for i in range(args.streams)))
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    tokens = sum(r.tokens for r in many)
    if not all(r.ok for r in [*singles, *many]):
        raise RuntimeError(f"a request failed: {[r.error for r in [*singles, *many] if not r.ok][:3]}")
    return {"conditional_header_stored": float(await _conditional(nats_url)),
            "tok_s": tokens / wall, "gen_cpu_s_per_1k_tokens": 1e3 * cpu / tokens,
            "ttft_added_p50_ms": pct(added, 50), "ttft_p50_ms": pct([r.ttft * 1e3 for r in singles], 50),
            "emitted_to_client_p50_ms": stage_breakdown(singles)[LAST_HOP]}


def run(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    order = [name for i in range(args.rounds)
             for name in (("conditional", args.b) if i % 2 == 0 else (args.b, "conditional"))]
    out: dict[str, list[dict[str, float]]] = {name: [] for name in ("conditional", args.b)}
    for n, name in enumerate(order, 1):
        launcher, extra = VARIANTS[name]
        env = {"TOKENPIPE_MAX_BATCH": str(max(args.streams, 1)), **extra}
        with Pipeline(args.model, args.data_dir, env, launcher=launcher) as pipe:
            assert pipe.generator is not None
            res = asyncio.run(_round(pipe.url, pipe.nats.url, pipe.generator.pid, args))
        out[name].append(res)
        print(f"[{n}/{len(order)}] {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
    return out


def summarize(out: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    def mean(name: str, key: str) -> float:
        return statistics.fmean(r[key] for r in out[name])

    c, u = out  # the conditional generator, and the B side
    return {**{f"{k}_{name}": mean(name, k) for name in (c, u) for k in out[c][0]},
            "tok_s_ratio": mean(c, "tok_s") / mean(u, "tok_s"),
            "cpu_ratio": mean(c, "gen_cpu_s_per_1k_tokens") / mean(u, "gen_cpu_s_per_1k_tokens"),
            "ttft_added_p50_delta_ms": mean(c, "ttft_added_p50_ms") - mean(u, "ttft_added_p50_ms"),
            "emitted_to_client_p50_delta_ms": mean(c, "emitted_to_client_p50_ms") - mean(u, "emitted_to_client_p50_ms")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per variant (alternated)")
    parser.add_argument("--ttft-requests", type=int, default=30)
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--b", choices=["unconditional", "no-hold"], default="unconditional",
                        help="what the conditional generator is compared with (the module docstring)")
    parser.add_argument("--out", default="bench/out/fencecost.json")
    args = parser.parse_args(argv)
    out = run(args)
    summary = summarize(out)
    print(f"\n| figure | conditional | {args.b} | ratio / delta |\n|---|---|---|---|")
    for key, label, cmp in (("tok_s", f"tokens/s at {args.streams} streams", "tok_s_ratio"),
                            ("gen_cpu_s_per_1k_tokens", "generator CPU s per 1k tokens", "cpu_ratio"),
                            ("ttft_added_p50_ms", "pipeline-added TTFT p50, ms", "ttft_added_p50_delta_ms"),
                            ("emitted_to_client_p50_ms", "first batch, emitted to the client, p50 ms",
                             "emitted_to_client_p50_delta_ms"),
                            ("ttft_p50_ms", "client TTFT p50, ms", None)):
        tail = f"{summary[cmp]:.3f}" if cmp else ""
        print(f"| {label} | {summary[key + '_conditional']:.2f} | {summary[f'{key}_{args.b}']:.2f} | {tail} |")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": vars(args),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "rounds": out, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
