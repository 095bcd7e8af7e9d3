"""Weight-only quantization: speed and quality side by side, one run.

    python -m bench.quant [--variants float32/none,float32/int8,...] [--threads N] [--device cuda]

For each variant (dtype/quant) of the real SmolLM2-135M: tokenpipe's own decode step at batch
1 and 32 (tok/s, context 104 like bench.pipeline), the prefill of one 64-token prompt (ms),
then quality against the first variant (fp32, unquantized): greedy agreement over
``--prompts`` chat prompts (``--new-tokens`` each; identical sequences, and the mean share of
tokens before the first divergence) and the mean log-likelihood per token of a fixed text
(delta in nats/token; perplexity), teacher-forced through the decode step. Speed rounds
alternate the variants (the order reversed every other round) and report each variant's
median, range, and its median per-round ratio to the baseline: this machine is shared, only
ratios within one run mean anything.

The code paths of a CPU with fewer extensions: ``python -m bench.ascpu avx2 -- python -m bench.quant``.
JSON goes to ``bench/out/quant.json`` (``quant-cuda.json`` with ``--device cuda``: torch's int8pack and
tinygemm int4 kernels on the GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from generator.engine.scheduler import Engine
from generator.model.loader import LoadedModel, load_model
from tokenpipe.settings import Settings
from tokenpipe.wire import SamplingParams

from .ceilings import decode_step_flops, gemm_peak_gflops, prefill_flops, sync
from .common import alternate, cpu_summary, write_json
from .kvstep import RawSteps

console = Console(width=190)

DEFAULT_VARIANTS = "float32/none,bfloat16/none,float32/int8,float32/int4,bfloat16/int8,bfloat16/int4"
CONTEXT = 104  # bench.pipeline's ceiling context: a ~40-token prompt plus half of 128 output tokens
QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one paragraph.",
             "Write a haiku about autumn.", "List three uses of a paperclip.", "How do vaccines work?",
             "Translate 'good morning' into Spanish and German.", "What is 17 times 23?",
             "Give me a tip for learning to program.", "Why is the sky blue?", "Describe a cat to a child.",
             "What causes the seasons on Earth?", "Name a famous painting and its painter.",
             "Summarise the plot of Romeo and Juliet.", "What does a compiler do?",
             "Suggest a name for a bakery.", "How many legs does a spider have?"]
# A fixed text for the log-likelihood comparison (plain English prose, ~230 tokens).
TEXT = ("The river starts high in the mountains, where snow melts slowly through the spring and early "
        "summer. At first it is only a thin stream that runs between stones, cold and clear enough to see "
        "the bottom. As it moves down the valley, other streams join it, and by the time it reaches the "
        "first village it is wide enough for a small wooden bridge. Farmers use its water for their fields, "
        "and children swim in the deeper pools on hot afternoons. Further down, the river slows and turns "
        "brown with the soil it carries from the hills. A town has grown up on both banks, with a market "
        "square, a church and a school. Boats carry grain and timber to the coast, where the river finally "
        "opens into a broad estuary and meets the sea. Birds gather on the mud flats at low tide, and the "
        "fishermen who live there say that the water changes colour with every season. In winter the river "
        "can flood, and the people of the valley have learned to build their houses on higher ground.")


def _rounds(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {k: [] for k in fns}
    items = list(fns.items())
    for r in range(rounds):
        for key, fn in alternate(items, r):
            res[key].append(fn())
    return res


def _decode(lm: LoadedModel, batch: int, steps: int) -> Callable[[], float]:
    attend = -(-(CONTEXT + steps + 8) // 32) * 32
    raw = RawSteps(lm, batch, attend)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40_000, (batch, CONTEXT), generator=gen).to(lm.device)
    tok = raw.prefill(ids).argmax(-1)
    pos = torch.full((batch,), CONTEXT, device=lm.device)

    def run() -> float:
        sync(lm.device)
        t0 = time.perf_counter()
        for i in range(steps):
            raw.decode(tok, pos + i, attend)
        sync(lm.device)
        return batch * steps / (time.perf_counter() - t0)

    run()
    return run


def _prefill_ms(lm: LoadedModel, length: int) -> Callable[[], float]:
    raw = RawSteps(lm, 1, max(length, 256))
    ids = torch.randint(100, 40_000, (1, length), generator=torch.Generator().manual_seed(1)).to(lm.device)

    def run() -> float:
        sync(lm.device)
        t0 = time.perf_counter()
        raw.prefill(ids)
        sync(lm.device)
        return (time.perf_counter() - t0) * 1e3

    run()
    return run


def _stats(values: list[float], base: list[float], lower_is_better: bool = False) -> dict[str, float]:
    ratios = [(b / v if lower_is_better else v / b) for v, b in zip(values, base, strict=True)]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def speed(lms: dict[str, LoadedModel], rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {k: {} for k in lms}
    base = next(iter(lms))
    for label, make, lower in (("decode_b1_tok_s", lambda lm: _decode(lm, 1, 8), False),
                               ("decode_b32_tok_s", lambda lm: _decode(lm, 32, 3), False),
                               ("prefill_64_ms", lambda lm: _prefill_ms(lm, 64), True)):
        console.print(f"[dim]speed: {label}[/]")
        res = _rounds({k: make(lm) for k, lm in lms.items()}, rounds)
        for k, values in res.items():
            out[k][label] = _stats(values, res[base], lower)
    return out


@torch.inference_mode()
def _loglik(lm: LoadedModel) -> float:
    """Mean log-probability per token of :data:`TEXT`, teacher-forced one token per decode step
    (the path that reads the quantized weights; a prefill of many rows reads the float ones)."""
    ids = lm.tokenizer.encode(TEXT)
    raw = RawSteps(lm, 1, len(ids) + 1)
    dev = lm.device
    logits = raw.prefill(torch.tensor([ids[:1]], device=dev))
    total = 0.0
    for pos in range(1, len(ids)):
        total += float(logits[0].float().log_softmax(-1)[ids[pos]])
        logits = raw.decode(torch.tensor([ids[pos]], device=dev), torch.tensor([pos], device=dev), pos + 1)
    return total / (len(ids) - 1)


def _greedy(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    engine = Engine(lm, max_batch=len(prompts))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.new_sequence(f"q{i}", p, params) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.run_to_completion()
    return [s.generated for s in seqs]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    same, shares = 0, []
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += n == len(a)
        shares.append(n / len(a))
    return same, statistics.mean(shares)


def quality(lms: dict[str, LoadedModel], n_prompts: int, new_tokens: int) -> dict[str, dict[str, float]]:
    first = next(iter(lms.values()))
    prompts = [first.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(n_prompts)]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    ref_tokens: list[list[int]] = []
    ref_ll = 0.0
    out: dict[str, dict[str, float]] = {}
    for i, (key, lm) in enumerate(lms.items()):
        console.print(f"[dim]quality: {key}[/]")
        tokens, ll = _greedy(lm, prompts, new_tokens), _loglik(lm)
        if i == 0:
            ref_tokens, ref_ll = tokens, ll
        same, share = _agreement(ref_tokens, tokens)
        out[key] = {"identical": same, "prompts": len(prompts), "prefix_share": share, "loglik": ll,
                    "loglik_delta": ll - ref_ll, "perplexity": float(torch.tensor(-ll).exp())}
    return out


def _gf(g: dict[str, float]) -> str:
    return (f"{g['decode_b32']:.0f} ({100 * g['decode_b32'] / g['peak']:.0f}%) · "
            f"{g['prefill_64']:.0f} ({100 * g['prefill_64'] / g['peak']:.0f}%)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.quant", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="dtype/quant pairs; the first is the baseline")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA kernels: int8pack, tinygemm int4)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    data_dir = args.data_dir or Settings.load().data_dir
    cpu = cpu_summary()
    console.print(f"[bold]bench.quant[/] · {cpu['line']} · torch {torch.__version__}, {torch.get_num_threads()} "
                  f"threads, kernels {torch.backends.cpu.get_cpu_capability()}")
    lms: dict[str, LoadedModel] = {}
    for v in args.variants.split(","):
        dtype, quant = v.split("/")
        lms[v] = load_model(args.model, device=args.device, dtype=dtype, quant=quant, data_dir=data_dir)
        fallbacks = [m for m in lms[v].model.modules() if getattr(m, "fallback", False)]
        if fallbacks:  # the numbers would be the float weights', not the quantized kernel's
            console.print(f"[yellow]{v}: {len(fallbacks)} layers have no working {quant} kernel on "
                          f"{args.device}; they run on float weights[/]")
    peaks = {str(dt): gemm_peak_gflops(dt, args.device) for dt in {lm.dtype for lm in lms.values()}}
    sp = speed(lms, args.rounds)
    for k, lm in lms.items():  # achieved GFLOP/s against the GEMM peak of the model's dtype
        peak = peaks[str(lm.dtype)]
        b32 = sp[k]["decode_b32_tok_s"]["median"] / 32 * decode_step_flops(lm.model, 32, CONTEXT + 4) / 1e9
        pre = prefill_flops(lm.model, 1, 64) / sp[k]["prefill_64_ms"]["median"] / 1e6
        sp[k]["gflops"] = {"decode_b32": b32, "prefill_64": pre, "peak": peak}
    q = quality(lms, args.prompts, args.new_tokens)
    base = next(iter(lms))
    t = Table(title=f"{args.model}: speed (median, × {base} as the median per-round ratio) and quality against {base}")
    for col in ("variant", "decode b1 tok/s", "×", "decode b32 tok/s", "×", "prefill 64 ms", "×",
                "GFLOP/s b32 · prefill (% peak)", "greedy identical", "prefix agree", "Δ loglik nats/tok", "ppl"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k in lms:
        s, qq = sp[k], q[k]
        t.add_row(k, f"{s['decode_b1_tok_s']['median']:.1f}", f"{s['decode_b1_tok_s']['ratio']:.2f}",
                  f"{s['decode_b32_tok_s']['median']:.1f}", f"{s['decode_b32_tok_s']['ratio']:.2f}",
                  f"{s['prefill_64_ms']['median']:.1f}", f"{s['prefill_64_ms']['ratio']:.2f}",
                  _gf(s["gflops"]),
                  f"{int(qq['identical'])}/{int(qq['prompts'])}", f"{qq['prefix_share']:.2f}",
                  f"{qq['loglik_delta']:+.4f}", f"{qq['perplexity']:.2f}")
    t.caption = (f"{cpu['line']}; torch kernels {torch.backends.cpu.get_cpu_capability()}, "
                 f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds; GEMM peak "
                 + ", ".join(f"{k.removeprefix('torch.')} {v:.0f}" for k, v in peaks.items()) + " GFLOP/s")
    console.print(t)
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None
    if gpu:
        console.print(f"device: {gpu}")
    result: dict[str, Any] = {"cpu": cpu, "device": args.device, "gpu": gpu,
                              "kernels": torch.backends.cpu.get_cpu_capability(),
                              "threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
                              "rounds": args.rounds, "gemm_peak_gflops": peaks, "speed": sp, "quality": q}
    out = Path(args.out or f"bench/out/quant{'-cuda' if gpu else ''}.json")
    write_json(out, result, indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
