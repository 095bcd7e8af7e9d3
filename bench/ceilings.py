"""In-process reference points for the engine: the raw forward ceiling and the baselines.

All of these run the model directly, with no NATS, no HTTP, no coalescing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from generator.engine.scheduler import Engine
from generator.model.llama import as_transformers
from generator.model.loader import LoadedModel
from tokenpipe.wire import SamplingParams

__all__ = ["EngineRun", "decode_step_flops", "engine_tok_s", "gemm_peak_gflops", "hf_generate_tok_s",
           "naive_no_cache_tok_s", "own_forward_tok_s", "prefill_flops", "raw_forward_tok_s", "sync"]


def _linear_params(model: Any) -> tuple[int, int]:
    """(weights in the decoder layers' projections, weights of lm_head): each is one
    multiply-add per token."""
    cfg = model.config
    D, inter, L = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers)
    hd = int(getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads)
    q, kv = int(cfg.num_attention_heads) * hd, int(cfg.num_key_value_heads) * hd
    per_layer = D * (q + 2 * kv) + q * D + 3 * D * inter
    return L * per_layer, D * int(cfg.vocab_size)


def _attention_flops(model: Any, queries: int, keys: int) -> float:
    cfg = model.config
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 2.0 * 2 * queries * keys * int(cfg.num_attention_heads) * hd * int(cfg.num_hidden_layers)


def decode_step_flops(model: Any, batch: int, context: int) -> float:
    """FLOPs of one decode step: every row reads every weight once and attends to ``context`` keys."""
    layers, head = _linear_params(model)
    return batch * (2.0 * (layers + head) + _attention_flops(model, 1, context))


def prefill_flops(model: Any, prompts: int, length: int) -> float:
    """FLOPs of prefilling ``prompts`` prompts of ``length`` tokens (lm_head on the last token only, causal)."""
    layers, head = _linear_params(model)
    return prompts * (2.0 * (layers * length + head) + _attention_flops(model, length, length) / 2)


def gemm_peak_gflops(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 1024,
                     repeats: int = 5) -> float:
    """The best GFLOP/s of a square ``size`` matmul here (same dtype, torch's current threads):
    the compute peak the decode step and the prefill are measured against."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best / 1e9


@torch.inference_mode()
def raw_forward_tok_s(lm: LoadedModel, batch: int, context: int, steps: int = 12) -> float:
    """Aggregate tok/s of one batched decode step with a warm KV cache of ``context`` tokens
    (transformers' own forward and cache, no sampling, no Python bookkeeping)."""
    model = as_transformers(lm.model)
    ids = torch.randint(100, 40_000, (batch, context), device=lm.device)
    out = model(ids, use_cache=True)
    cache = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3):  # warm-up
        out = model(tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    sync(lm.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    sync(lm.device)
    return batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def own_forward_tok_s(lm: LoadedModel, batch: int, context: int, steps: int = 12) -> float:
    """The same measurement with tokenpipe's own decode step (paged cache, grouped-query attention)."""
    from .kvstep import RawSteps

    attend = -(-(context + steps + 4) // 32) * 32
    raw = RawSteps(lm, batch, attend)
    ids = torch.randint(100, 40_000, (batch, context), device=lm.device)
    tok = raw.prefill(ids).argmax(-1)
    pos = torch.full((batch,), context, device=lm.device)
    for i in range(3):
        raw.decode(tok, pos + i, attend)
    sync(lm.device)
    t0 = time.perf_counter()
    for i in range(steps):
        raw.decode(tok, pos + 3 + i, attend)
    sync(lm.device)
    return batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_generate_tok_s(lm: LoadedModel, prompt: list[int], new_tokens: int, requests: int = 2) -> float:
    """transformers ``generate`` one request at a time (batch 1, greedy)."""
    ids = torch.tensor([prompt], device=lm.device)
    hf = as_transformers(lm.model)
    hf.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    for _ in range(requests):
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(lm.device)
    return requests * new_tokens / (time.perf_counter() - t0)


@torch.inference_mode()
def naive_no_cache_tok_s(lm: LoadedModel, prompt: list[int], new_tokens: int) -> float:
    """Re-run the whole sequence for every token: what a KV cache saves."""
    seq = torch.tensor([prompt], device=lm.device)
    hf = as_transformers(lm.model)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = hf(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    sync(lm.device)
    return new_tokens / (time.perf_counter() - t0)


@dataclass
class EngineRun:
    tok_s: float
    ttft_s: float
    wall_s: float
    tokens: int


def engine_tok_s(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, max_batch: int,
                 cuda_graphs: str = "off", max_seq_len: int = 2048) -> EngineRun:
    """Our engine in-process: all prompts submitted at t=0, run to completion."""
    engine = Engine(lm, max_batch=max_batch, max_seq_len=max_seq_len, cuda_graphs=cuda_graphs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for s in seqs:
        engine.add(s)
    first = None
    while not engine.idle:
        engine.step()
        if first is None:
            first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    total = sum(len(s.generated) for s in seqs)
    return EngineRun(total / wall, first or 0.0, wall, total)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA runs them asynchronously): time what ran, not what
    was queued. Nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
