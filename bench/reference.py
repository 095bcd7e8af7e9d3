"""The pipeline benchmark's in-process phase: the engine and its reference points, no NATS, no HTTP.

Raw forward step at the stream count (fp32 and bf16: the ceiling is the faster), tokenpipe's
own decode step, the engine-vs-ceiling sweep, the engine's TTFT at one stream, HF generate one
request at a time and the naive loop without a KV cache (:mod:`bench.ceilings` measures each).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

import torch
from rich.progress import Progress

from generator.model.loader import LoadedModel, load_model
from tokenpipe_cli.stats import percentile

from . import ceilings
from .common import chat

__all__ = ["engine_again", "measure_engine", "prompt_ids"]


def prompt_ids(lm: LoadedModel, n: int) -> list[list[int]]:
    """The token ids of the first ``n`` benchmark prompts, chat template applied."""
    return [lm.tokenizer.apply_chat_template(chat(i), add_generation_prompt=True, tokenize=True)["input_ids"]
            for i in range(n)]


def measure_engine(lm: LoadedModel, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    prompts = prompt_ids(lm, max([args.streams, *args.engine_batches]))
    prompt_len = round(statistics.mean(len(p) for p in prompts))
    context = prompt_len + args.max_tokens // 2
    out: dict[str, Any] = {"prompt_tokens_mean": prompt_len, "ceiling_context": context}
    task = progress.add_task("in-process reference points", total=5 + len(args.engine_batches))
    other = "float32" if lm.dtype == torch.bfloat16 else "bfloat16"
    lm_other = load_model(args.model, device=args.device, dtype=other, data_dir=args.data_dir)
    by_dtype = {str(lm.dtype).removeprefix("torch."): lm, other: lm_other}
    out["raw_forward_fp32_tok_s"] = ceilings.raw_forward_tok_s(by_dtype["float32"], args.streams, context)
    out["raw_forward_bf16_tok_s"] = ceilings.raw_forward_tok_s(by_dtype["bfloat16"], args.streams, context)
    out["own_forward_tok_s"] = ceilings.own_forward_tok_s(lm, args.streams, context)
    # How close the decode step comes to the compute peak (same dtype, same threads).
    out["gemm_peak_gflops"] = ceilings.gemm_peak_gflops(lm.dtype, lm.device)
    out["own_forward_gflops"] = (out["own_forward_tok_s"] / args.streams
                                 * ceilings.decode_step_flops(lm.model, args.streams, context) / 1e9)
    out["engine_quant"] = lm.quant
    out["engine_dtype"] = str(lm.dtype).removeprefix("torch.")
    out["engine_sweep"] = {}
    for n in args.engine_batches:
        # Engine goal of the benchmark issue: aggregate decode tok/s at n streams vs the raw step at batch n.
        ceiling = max(ceilings.raw_forward_tok_s(m, n, context) for m in by_dtype.values())
        run = ceilings.engine_tok_s(lm, prompts[:n], args.max_tokens, max_batch=n, cuda_graphs=args.cuda_graphs)
        out["engine_sweep"][str(n)] = {"ceiling_tok_s": ceiling, "engine_tok_s": run.tok_s,
                                       "ratio": run.tok_s / ceiling}
        progress.advance(task)
    del lm_other, by_dtype
    gc.collect()
    progress.advance(task)
    out["ceiling_tok_s"] = max(out["raw_forward_fp32_tok_s"], out["raw_forward_bf16_tok_s"])
    run = ceilings.engine_tok_s(lm, prompts[: args.streams], args.max_tokens, max_batch=args.streams,
                                 cuda_graphs=args.cuda_graphs, max_seq_len=args.max_seq_len)
    out["engine_tok_s_before"] = run.tok_s
    out["engine_wall_s"] = run.wall_s
    progress.advance(task)
    ttfts = sorted(ceilings.engine_tok_s(lm, [prompts[i % len(prompts)]], 1, max_batch=1,
                                         cuda_graphs=args.cuda_graphs).ttft_s for i in range(args.ttft_requests))
    out["engine_ttft_p50_ms"] = percentile(ttfts, 0.50) * 1e3
    out["engine_ttft_p99_ms"] = percentile(ttfts, 0.99) * 1e3
    progress.advance(task)
    out["hf_generate_1_at_a_time_tok_s"] = ceilings.hf_generate_tok_s(lm, prompts[0], args.baseline_tokens, 1)
    progress.advance(task)
    out["naive_no_kv_cache_tok_s"] = ceilings.naive_no_cache_tok_s(lm, prompts[0], args.baseline_tokens // 2)
    progress.advance(task)
    return out


def engine_again(lm: LoadedModel, eng: dict[str, Any], args: argparse.Namespace) -> None:
    """The engine once more, after the pipeline: this machine's speed drifts (shared cores), so
    the pipeline is compared with the mean of the engine measured before and after it."""
    after = ceilings.engine_tok_s(lm, prompt_ids(lm, args.streams), args.max_tokens, max_batch=args.streams,
                                 cuda_graphs=args.cuda_graphs, max_seq_len=args.max_seq_len)
    eng["engine_tok_s_after"] = after.tok_s
    eng["engine_tok_s"] = (eng["engine_tok_s_before"] + after.tok_s) / 2
