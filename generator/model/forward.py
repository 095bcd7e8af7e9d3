"""A compact Llama-family forward pass over the paged KV cache (gpt-fast style).

The weights and the norm/MLP/rotary modules are the transformers model's own; only
attention is ours, so that every sequence in a batch keeps its own position and a
sequence can join or leave the batch between steps without touching the others.

K/V live in :class:`~generator.model.kvcache.PagedKVCache` blocks: each step writes the new
positions through a flat slot index and reads each row's blocks through its block table.
Shape legend: B rows, S prompt length, T attended length (table width × block size),
D model dim, H heads, G kv heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .kvcache import BLOCK_SIZE, PagedKVCache
from .layers import mlp_block, qkv, rms_norm, rotary
from .plan import plan_for

__all__ = ["decode_step", "prefill"]


@torch.inference_mode()
def prefill(model: Any, cache: PagedKVCache, input_ids: Tensor, positions: Tensor, slots: Tensor, lengths: Tensor,
            tables: Tensor | None) -> Tensor:
    """Run right-padded prompt tails ``input_ids [N, S]`` at ``positions [N, S]`` into the cache.

    ``slots [N, S]`` are the flat cache positions each token's K/V is written to (padding goes
    to the scratch block); ``lengths [N]`` the real tokens per row. ``tables [N, n]`` is given
    when some row continues a cached prefix: attention then reads the row's blocks; without it
    every row starts at position 0 and attends causally over its own fresh K/V. Returns the
    logits of each row's last real token, ``[N, V]``. Padding sits after the real tokens, so a
    real token never sees it.
    """
    inner, plan = model.model, plan_for(model)
    N, S = input_ids.shape
    x = inner.embed_tokens(input_ids)  # [N, S, D]
    rot = rotary(*inner.rotary_emb(x, positions))  # cos/sin [N, S, hd]
    flat_slots = slots.reshape(-1)
    mask = None
    if tables is not None:
        cols = torch.arange(tables.shape[1] * BLOCK_SIZE, device=input_ids.device)
        mask = (cols[None, None, :] <= positions[:, :, None])[:, None]  # [N, 1, S, T]
    for li, (layer, lp) in enumerate(zip(inner.layers, plan.layers, strict=True)):
        attn = layer.self_attn
        q, k, v = qkv(attn, lp, rms_norm(layer.input_layernorm, x), rot, cache.head_dim)  # k, v [N, G, S, hd]
        cache.write(li, k.permute(1, 0, 2, 3).reshape(k.shape[1], N * S, -1),
                    v.permute(1, 0, 2, 3).reshape(v.shape[1], N * S, -1), flat_slots)
        if tables is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        else:
            kc, vc = cache.gather(li, tables)  # [G, N, T, hd]
            o = F.scaled_dot_product_attention(q, kc.transpose(0, 1), vc.transpose(0, 1), attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=True)
        x = x + lp.o(o.transpose(1, 2).reshape(N, S, -1))  # [N, S, D]
        x = mlp_block(layer, lp, x)
    last = x[torch.arange(N, device=x.device), lengths - 1]  # [N, D]: only these rows need logits
    return plan.lm_head(rms_norm(inner.norm, last))  # [N, V]


@torch.inference_mode()
def decode_step(model: Any, cache: PagedKVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
                tables: Tensor) -> Tensor:
    """One token for each row: ``tokens [B]`` at ``positions [B]``, K/V written at the flat cache
    positions ``slots [B]``; attention reads the blocks of ``tables [B, n]`` (padded with the
    scratch block; a fixed ``n`` keeps every shape static). Returns ``[B, V]``.

    The plan's attention backend (:class:`~generator.model.attention.DecodeAttention`, chosen when the
    plan was built) picks the step's one path from its row count: the plan's kernel over the pool up to
    its ``paged_attention_rows``; RMSNorm, RoPE with the cache write and SiLU(gate) * up the library's ops
    where the plan has them (``step_ops``; a prefill's many rows take torch's vectorized ones); with those,
    where the plan has a stack and every layer projection's kernel at ``B`` rows is the library's, the
    decoder layers are one call (:mod:`generator.model.stack`, the same results to the bit).
    """
    inner, plan = model.model, plan_for(model)
    x = inner.embed_tokens(tokens[:, None])  # [B, 1, D]
    rot = rotary(*inner.rotary_emb(x, positions[:, None]))  # cos/sin [B, 1, hd]
    path = plan.attention.path(model, plan, cache, x, rot, positions, slots, tables)  # one path for every layer
    return plan.lm_head(rms_norm(inner.norm, path.layers(x), plan.step_ops))  # [B, V]
