"""What each projection kernel costs in accuracy: teacher-forced next-token loss with every decode step on it.

    python -m bench.accuracy [--kernels dense,quant,gemv,gemm8] [--rows 4] [--tokens 128]
                             [--out bench/out/accuracy.json]

Loads the default model as a generator does and reads ``--rows`` windows of a fixed English text
(``docs/architecture.md``, so every checkout reads the same words), each prefilled with its first 8
tokens (on the float weight, as the engine prefills), then decoded one position at a time, fed the
text's own next token whatever the model predicted: each decode step's projections run on one
kernel (``TOKENPIPE_KERNELS`` forced per variant). Reports the mean negative log-likelihood of the
text's tokens, its perplexity, and how often the greedy token agrees with the ``dense`` variant's.
The kernels round differently (``quant``'s rows are bf16, ``gemv``'s int16, ``gemm8``'s int8 per group
of 32): this shows what that does to the model, where a kernel test only shows the product's error.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import write_json
from bench.kvstep import RawSteps, add_model_args, load_as_generator
from generator.model.autotune import tune_plan
from generator.model.loader import LoadedModel
from generator.model.plan import plan_for
from tokenpipe.settings import Settings

console = Console()
TEXT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
PREFIX = 8  # tokens prefilled per window


def windows(lm: LoadedModel, rows: int, tokens: int) -> torch.Tensor:
    """``rows`` windows of ``PREFIX + tokens`` token ids spread over the text: ``[rows, PREFIX + tokens]``."""
    ids = lm.tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    span = PREFIX + tokens
    if len(ids) < rows * span:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than {rows} windows of {span}")
    step = (len(ids) - span) // max(rows - 1, 1)
    return torch.tensor([ids[i * step:i * step + span] for i in range(rows)])


def score(lm: LoadedModel, seq: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean NLL of ``seq``'s tokens after the prefix, and the greedy token at each decoded position."""
    rows, span = seq.shape
    raw = RawSteps(lm, rows, span + 1)
    nll, greedy = 0.0, []
    with torch.inference_mode():
        logits = raw.prefill(seq[:, :PREFIX])
        for t in range(PREFIX, span):
            logp = torch.log_softmax(logits.float(), -1)
            nll -= float(logp[torch.arange(rows), seq[:, t]].sum())
            greedy.append(logp.argmax(-1))
            if t + 1 < span:
                logits = raw.decode(seq[:, t], torch.full((rows,), t), t + 1)
    return nll / (rows * (span - PREFIX)), torch.stack(greedy, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--kernels", default="dense,quant,gemv,gemm8")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--label", default="")
    add_model_args(ap)
    ap.add_argument("--out", default="bench/out/accuracy.json")
    args = ap.parse_args(argv)
    lm, cpu = load_as_generator(args, "bench.accuracy")
    if lm.quant == "none":
        ap.error("the model is not quantized (TOKENPIPE_QUANT=none): every kernel is the float weight")
    s = Settings.load(**({"data_dir": args.data_dir} if args.data_dir else {}))
    seq = windows(lm, args.rows, args.tokens)
    results: dict[str, Any] = {}
    picks: dict[str, torch.Tensor] = {}
    for kernel in args.kernels.split(","):
        console.print(f"[dim]{kernel}: {args.rows} windows × {args.tokens} decode steps[/]")
        tune_plan(lm.model, plan_for(lm.model), name=lm.name, dtype=lm.dtype, dense_rows=s.max_batch,
                  max_batch=args.rows, data_dir=s.data_dir, setting=kernel)
        nll, picks[kernel] = score(lm, seq)
        results[kernel] = {"nll": nll, "perplexity": math.exp(nll)}
    first = next(iter(picks))
    t = Table(title=f"{lm.name} {lm.quant} {str(lm.dtype).removeprefix('torch.')}: teacher-forced loss per kernel "
                    f"({args.rows} × {args.tokens} tokens of {TEXT.name})")
    for col in ("kernel", "mean NLL", "perplexity", "Δ NLL", f"greedy = {first}'s"):
        t.add_column(col, justify="right")
    for kernel, res in results.items():
        res["greedy_agrees"] = float((picks[kernel] == picks[first]).float().mean())
        t.add_row(kernel, f"{res['nll']:.4f}", f"{res['perplexity']:.2f}", f"{res['nll'] - results[first]['nll']:+.4f}",
                  f"{res['greedy_agrees']:.1%}")
    console.print(t)
    out = write_json(args.out, {"label": args.label, "cpu": cpu, "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "model": lm.name, "quant": lm.quant,
                                "dtype": str(lm.dtype), "rows": args.rows, "tokens": args.tokens, "text": TEXT.name,
                                "results": results})
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
