"""Decode with and without CUDA graphs, each figure as a ratio to its limit (``bench/gpu.sh``).

    python -m bench.cudagraphs [--models llama-1b-random,llama-8b-random] [--batches 1,64]
                               [--out bench/out/gpu-cudagraphs.json]
    python -m bench.cudagraphs --dry-run    # CPU: tiny shapes, the eager path only (a test runs it)

For each random-weight Llama shape (Llama-3.2-1B's; Llama-3.1-8B's: hidden 4096, 32 layers, 32
heads, 8 KV heads, intermediate 14336, vocabulary 128256; bf16) the engine decodes ``--steps``
steps at each batch size over a ``--context``-token cache, with the decode step eager
(``TOKENPIPE_CUDA_GRAPHS=off``) and captured per batch bucket (``on``). Limits, measured in the
same run: the device's copy bandwidth (a device-to-device copy, bytes read + written per second)
and its bf16 GEMM peak (a large square matmul). Each row gives

- ``bw``: weight bytes × steps/s ÷ copy bandwidth (1.0 = every step reads the weights at the
  copy speed; the batch-1 decode limit);
- ``flops``: decode FLOP/s ÷ GEMM peak (the large-batch limit);
- ``graphs ÷ eager`` for the same model and batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from generator.engine.scheduler import Engine
from generator.model.kvcache import bytes_per_position
from generator.model.loader import LoadedModel
from generator.model.plan import build_plan
from tokenpipe.errors import ConfigError
from tokenpipe.wire import SamplingParams

from .ceilings import decode_step_flops, gemm_peak_gflops, sync
from .common import write_json

__all__ = ["SHAPES", "copy_bandwidth_gbs", "decode_tok_s", "main", "random_model"]

SHAPES: dict[str, dict[str, int]] = {
    "tiny-random": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 512},
    "llama-1b-random": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "llama-8b-random": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
}


def random_model(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A random-weight Llama of ``SHAPES[name]``, built where it runs (no tokenizer: token ids only)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_dict({"max_position_embeddings": 4096, "tie_word_embeddings": name != "llama-8b-random",
                                    **SHAPES[name]})
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    build_plan(model)
    return LoadedModel(name, model, None, frozenset(), device, dtype)


def copy_bandwidth_gbs(device: torch.device, mib: int = 2048, repeats: int = 5) -> float:
    """Best GB/s of a device-to-device copy of ``mib`` MiB, counting the bytes read and written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def decode_tok_s(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Aggregate tok/s of ``steps`` decode steps of ``batch`` rows after a ``context``-token prefill."""
    vocab = int(engine.model.config.vocab_size)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(1, vocab, (context,), generator=gen).tolist()
        engine.add(engine.new_sequence(f"r{i}", prompt, params))
    engine.step()  # the prefill
    engine.step()  # one decode step outside the clock
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()  # ends in the sampled tokens' copy to the host: the step is done
    wall = time.perf_counter() - t0
    engine.run_to_completion()
    return batch * steps / wall


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "copy_gb_s": copy_bandwidth_gbs(device, mib=64 if args.dry_run else 2048),
                           "gemm_peak_gflops": gemm_peak_gflops(dtype, device, size=256 if args.dry_run else 8192),
                           "models": {}}
    for name in args.models:
        lm = random_model(name, device, dtype)
        weight_bytes = decode_step_flops(lm.model, 1, 0) / 2 * dtype.itemsize  # every projection weight once
        rows: dict[str, Any] = {"weight_gb": weight_bytes / 1e9}
        max_batch = max(args.batches)
        seq_len = args.context + args.steps + 16
        kv_mb = max_batch * (seq_len + 32) * bytes_per_position(lm.model, dtype) / 2**20
        for graphs in ("off", "on"):
            try:
                engine = Engine(lm, max_batch=max_batch, max_seq_len=seq_len, kv_cache_mb=kv_mb,
                                cuda_graphs=graphs)
            except ConfigError as exc:  # CUDA graphs on a CPU: the fallback says why
                rows[f"graphs_{graphs}"] = {"skipped": exc.message}
                continue
            for batch in args.batches:
                tok_s = decode_tok_s(engine, batch, args.context, args.steps)
                steps_s = tok_s / batch
                rows.setdefault(f"graphs_{graphs}", {})[str(batch)] = {
                    "tok_s": tok_s, "step_ms": 1e3 / steps_s,
                    "bw": weight_bytes * steps_s / (out["copy_gb_s"] * 1e9),
                    "flops": decode_step_flops(lm.model, batch, args.context) * steps_s
                    / (out["gemm_peak_gflops"] * 1e9)}
            del engine
        on, off = rows.get("graphs_on", {}), rows.get("graphs_off", {})
        rows["graphs_over_eager"] = {b: on[b]["tok_s"] / off[b]["tok_s"] for b in off if b in on and "tok_s" in on[b]}
        out["models"][name] = rows
        del lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def render(results: dict[str, Any]) -> str:
    lines = [f"{results['device']}: copy {results['copy_gb_s']:.0f} GB/s, GEMM peak "
             f"{results['gemm_peak_gflops']:.0f} GFLOP/s",
             f"{'model':<18}{'graphs':>7}{'batch':>6}{'tok/s':>10}{'step ms':>9}{'bw':>7}{'flops':>7}{'×eager':>8}"]
    for name, rows in results["models"].items():
        for graphs in ("off", "on"):
            runs = rows.get(f"graphs_{graphs}", {})
            if "skipped" in runs:
                lines.append(f"{name:<18}{graphs:>7}  skipped: {runs['skipped']}")
                continue
            for batch, r in runs.items():
                x = rows["graphs_over_eager"].get(batch, 1.0) if graphs == "on" else 1.0
                lines.append(f"{name:<18}{graphs:>7}{batch:>6}{r['tok_s']:>10.0f}{r['step_ms']:>9.2f}"
                             f"{r['bw']:>7.2f}{r['flops']:>7.3f}{x:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda v: v.split(","), default=["llama-1b-random", "llama-8b-random"])
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, a few steps: the code paths without a GPU (graphs: the fallback)")
    parser.add_argument("--out", default="bench/out/gpu-cudagraphs.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.models, args.batches = "cpu", "float32", ["tiny-random"], [1, 4]
        args.context, args.steps = 16, 3
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu_count": os.cpu_count(),
               "config": {k: v for k, v in vars(args).items() if k != "out"}, **measure(args)}
    print(render(results))
    out = Path(args.out)
    write_json(out, results, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
