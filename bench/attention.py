"""Decode attention for one layer: the torch ops the forward ran against the library's kernel over the pool.

    python -m bench.attention [--rows 1,2,4,8,16,32] [--context 128,512] [--rounds 7] [--out bench/out/attention.json]

Loads the default model as a generator does (its dtype, its KV cache layout) and, for each row count
and context length, times one layer's decode attention three ways, alternated round by round, the
fastest round counting: *bagged* (K gathered from the row's blocks, scores by batched matmul, V summed
by ``embedding_bag`` in place: the forward's path past ``attention_fp32_rows``), *fp32* (K and V
gathered and cast, SDPA: its path up to there), and *kernel* (``tokenpipe.paged_attention``,
``generator/kernels/csrc/attention.c``: read in place). Every row attends the whole context; each result is
checked against the kernel's. The machine may be shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import write_json
from bench.kvstep import add_model_args, load_as_generator
from generator.kernels.build import load_gemv
from generator.model.attention import (
    attention_bias,
)
from generator.model.attention import (
    bagged_attention as _bagged_attention,
)
from generator.model.attention import (
    decode_attention as _decode_attention,
)
from generator.model.kerneltable import timed
from generator.model.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from generator.model.loader import LoadedModel
from tokenpipe.settings import Settings

console = Console()


def one(lm: LoadedModel, rows: int, context: int, rounds: int) -> dict[str, Any]:
    """The three ways at ``rows`` rows attending ``context`` positions each: µs per call (the fastest round)."""
    H, scale = int(lm.model.config.num_attention_heads), float(lm.model.model.layers[0].self_attn.scaling)
    width = -(-context // BLOCK_SIZE)
    cache = PagedKVCache(lm.model, (rows * width + 1) * BLOCK_SIZE * bytes_per_position(lm.model, lm.dtype),
                         lm.device, lm.dtype, min_positions=context)
    gen = torch.Generator().manual_seed(rows)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=gen).to(lm.dtype))
    G, hd = cache.kv_heads, cache.head_dim
    tables = (1 + torch.arange(rows * width)).view(rows, width)
    positions = torch.full((rows,), context - 1)
    q = torch.randn(rows, 1, H, hd, generator=gen).to(lm.dtype).transpose(1, 2)  # [B, H, 1, hd] as the step's
    bias = attention_bias(torch.arange(width * BLOCK_SIZE)[None, :] <= positions[:, None])  # [B, T]
    bags = cache.value_bags(tables, H // G)

    def bagged() -> torch.Tensor:
        return _bagged_attention(q, cache, 0, tables, bags, bias, scale)[:, :, 0]

    def fp32() -> torch.Tensor:
        kc, vc = cache.gather(0, tables)
        return _decode_attention(q, kc, vc, bias, scale, rows)[:, :, 0]

    def kernel() -> torch.Tensor:
        out: torch.Tensor = torch.ops.tokenpipe.paged_attention(q[:, :, 0], cache.k[0], cache.v[0], tables,
                                                                 positions, scale)
        return out

    ref = kernel().float()
    for fn in (bagged, fp32):
        err = float((fn().float() - ref).abs().max())
        assert err < 0.05, f"{fn.__name__} differs from the kernel by {err} at {rows} rows, {context} positions"
    # rounds alternate the three (a busy spell slows them alike), each at least 2 ms of calls
    best = timed({"bagged": bagged, "fp32": fp32, "kernel": kernel}, rounds=rounds, min_s=0.002)
    return {"context": context, "rows": rows, "us": {k: v * 1e6 for k, v in best.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--context", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--label", default="")
    add_model_args(ap)
    ap.add_argument("--out", default="bench/out/attention.json")
    args = ap.parse_args(argv)
    lm, cpu = load_as_generator(args, "bench.attention")
    if load_gemv(args.data_dir or Settings.load().data_dir) is None:
        ap.error("the kernel library does not build here (see the log line above)")
    results = []
    t = Table(title=f"{lm.name} {str(lm.dtype).removeprefix('torch.')}: one layer's decode attention, µs "
                    "(fastest round; × = bagged ÷ kernel)")
    for col in ("context", "rows", "bagged", "fp32", "kernel", "×"):
        t.add_column(col, justify="right")
    for context in (int(c) for c in args.context.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            res = one(lm, rows, context, args.rounds)
            results.append(res)
            best = res["us"]
            t.add_row(str(context), str(rows), *(f"{best[k]:.1f}" for k in ("bagged", "fp32", "kernel")),
                      f"{best['bagged'] / best['kernel']:.2f}")
    console.print(t)
    out = Path(args.out)
    write_json(out, {"label": args.label, "cpu": cpu, "threads": torch.get_num_threads(),
                               "torch": torch.__version__, "model": lm.name, "dtype": str(lm.dtype),
                               "results": results}, indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
