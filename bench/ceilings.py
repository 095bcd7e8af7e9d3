"""In-process reference points for the engine: the raw forward ceiling and the baselines.

All of these run the model directly, with no NATS, no HTTP, no coalescing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from generator.engine import Engine
from generator.models import LoadedModel
from tokenpipe.wire import SamplingParams

__all__ = ["EngineRun", "engine_tok_s", "hf_generate_tok_s", "naive_no_cache_tok_s", "own_forward_tok_s",
           "raw_forward_tok_s"]


@torch.inference_mode()
def raw_forward_tok_s(lm: LoadedModel, batch: int, context: int, steps: int = 12) -> float:
    """Aggregate tok/s of one batched decode step with a warm KV cache of ``context`` tokens
    (transformers' own forward and cache, no sampling, no Python bookkeeping)."""
    model = lm.model
    ids = torch.randint(100, 40_000, (batch, context), device=lm.device)
    out = model(ids, use_cache=True)
    cache = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3):  # warm-up
        out = model(tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    _sync(lm)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    _sync(lm)
    return batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def own_forward_tok_s(lm: LoadedModel, batch: int, context: int, steps: int = 12) -> float:
    """The same measurement with tokenpipe's own decode step (slot cache, grouped-query attention)."""
    from generator.forward import SlotKVCache, decode_step, prefill

    attend = -(-(context + steps + 4) // 32) * 32
    cache = SlotKVCache(lm.model, batch, attend, lm.device, lm.dtype)
    cache.ensure(attend)
    ids = torch.randint(100, 40_000, (batch, context), device=lm.device)
    tok = prefill(lm.model, cache, ids, torch.full((batch,), context, device=lm.device), 0).argmax(-1)
    pos = torch.full((batch,), context, device=lm.device)
    for i in range(3):
        decode_step(lm.model, cache, tok, pos + i, attend)
    _sync(lm)
    t0 = time.perf_counter()
    for i in range(steps):
        decode_step(lm.model, cache, tok, pos + 3 + i, attend)
    _sync(lm)
    return batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_generate_tok_s(lm: LoadedModel, prompt: list[int], new_tokens: int, requests: int = 2) -> float:
    """transformers ``generate`` one request at a time (batch 1, greedy)."""
    ids = torch.tensor([prompt], device=lm.device)
    lm.model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    for _ in range(requests):
        lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(lm)
    return requests * new_tokens / (time.perf_counter() - t0)


@torch.inference_mode()
def naive_no_cache_tok_s(lm: LoadedModel, prompt: list[int], new_tokens: int) -> float:
    """Re-run the whole sequence for every token: what a KV cache saves."""
    seq = torch.tensor([prompt], device=lm.device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = lm.model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    _sync(lm)
    return new_tokens / (time.perf_counter() - t0)


@dataclass
class EngineRun:
    tok_s: float
    ttft_s: float
    wall_s: float
    tokens: int


def engine_tok_s(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, max_batch: int) -> EngineRun:
    """Our engine in-process: all prompts submitted at t=0, run to completion."""
    engine = Engine(lm, max_batch=max_batch, max_seq_len=2048)
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


def _sync(lm: LoadedModel) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
