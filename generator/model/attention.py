"""Decode attention: one backend per plan (:class:`DecodeAttention`), one path per step, the same for every layer.

A plan's backend is chosen when the plan is built, from what the model is (Qwen3's per-head norms, its
activation, its heads). At each step it picks the one path the step's row count takes, by the limits the
kernel table measured (the plan's ``paged_attention_rows``, ``attention_fp32_rows``) and the library's ops
(``step_ops``, the ``stack``); every decoder layer of the step then runs that path:

- :class:`StackPath`: the decoder layers in one call (``generator/kernels/csrc/stack_op.cpp``), where every
  layer projection's kernel at the step's rows is the library's;
- :class:`FusedPagedPath`: RoPE with the cache write as one op (``pointwise.c``), then ``attention.c``'s
  kernel over the pool;
- :class:`PagedPath`: the kernel over the pool after torch's q/k/v (Qwen3's per-head norms come before RoPE);
- :class:`GatheredPath`: the torch ops over K and V gathered from the blocks (fp32 for a few rows);
- :class:`BaggedPath`: the torch ops gathering only K, ``probs @ V`` an ``embedding_bag`` over the pool.

Shape legend: B rows, T attended length (table width × block size), D model dim, H heads, G kv heads,
hd head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .kvcache import BLOCK_SIZE, PagedKVCache
from .layers import LayerPlan, mlp_block, ops_take, qkv, rms_norm
from .stack import LayerStack

__all__ = ["FP32_ATTENTION_ROWS", "BaggedPath", "DecodeAttention", "DecodePath", "FusedPagedPath", "GatheredPath",
           "PagedPath", "StackPath", "StepPlan", "attention_bias", "bagged_attention", "decode_attention"]

FP32_ATTENTION_ROWS = 2  # by rule, decode steps of at most this many rows read a 16-bit KV cache in fp32


class StepPlan(Protocol):
    """What a decode step reads of its plan (:class:`generator.model.plan.Plan`)."""

    layers: list[LayerPlan]
    attention_fp32_rows: int
    paged_attention_rows: int
    step_ops: bool
    stack: LayerStack | None


def attention_bias(mask: Tensor) -> Tensor:
    """``mask [B, T]`` (True = attend) as the additive fp32 bias the decode attention takes,
    ``[B, T]`` of 0 and -inf: built once per step, so a layer adds it in the op that scales."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float,
                     fp32_rows: int = FP32_ATTENTION_ROWS) -> Tensor:
    """Single-query attention with grouped KV heads.

    In bf16, two small batched matmuls: for one query token several times faster on CPU than
    SDPA's flash kernel with a mask, and no repeat of K/V per query head. In fp32 on CPU, SDPA
    (GQA, the bias as its mask), where the matmul path's eight ops cost more in dispatch than in
    arithmetic at the few rows and short contexts of a decode step. A bf16 cache is read in fp32 for up to
    ``fp32_rows`` rows (:data:`FP32_ATTENTION_ROWS` by rule, else the plan's measured figure,
    :mod:`generator.model.kerneltable`): CPU bf16 matmuls this small cost more than the cast.
    q [B, H, 1, hd]; k, v [G, B, T, hd] (as gathered from the blocks); bias [B, T]
    (:func:`attention_bias`) -> [B, H, 1, hd]
    """
    B, H, _, hd = q.shape
    G = k.shape[0]
    out_dtype = q.dtype
    if fp32_rows >= B and q.device.type == "cpu" and q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu" and q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias[:, None, None, :],
                                              scale=scale, enable_gqa=True).to(out_dtype)
    qg = q.view(B, G, H // G, hd).transpose(0, 1)  # [G, B, H/G, hd]: query head g * (H/G) + r reads kv head g
    scores = torch.add(bias[:, None], torch.matmul(qg, k.transpose(-1, -2)).float(), alpha=scale)  # [G, B, H/G, T]
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(B, H, 1, hd).to(out_dtype)


def bagged_attention(q: Tensor, cache: PagedKVCache, layer: int, tables: Tensor, bags: tuple[Tensor, Tensor],
                     bias: Tensor, scale: float) -> Tensor:
    """Decode attention that gathers only K: ``probs @ V`` is an ``embedding_bag`` (weighted sum)
    over the pool's V rows in place. Gathering V as well cost a third of a 32-row step at 512
    positions (its copy is as large as the matmul's read). q [B, H, 1, hd] -> [B, H, 1, hd]"""
    B, H, _, hd = q.shape
    G = cache.kv_heads
    kc = cache.gather_k(layer, tables)  # [G, B, T, hd]
    qg = q.view(B, G, H // G, hd).transpose(0, 1)  # [G, B, H/G, hd]
    probs = torch.add(bias[:, None], torch.matmul(qg, kc.transpose(-1, -2)).float(), alpha=scale).softmax(-1)
    values = cache.v[layer].reshape(-1, hd)  # [G * blocks * BLOCK_SIZE, hd]: a view of the pool
    index, offsets = bags
    o = F.embedding_bag(index, values, offsets, mode="sum", per_sample_weights=probs.to(values.dtype).reshape(-1))
    return o.view(G, B, H // G, hd).transpose(0, 1).reshape(B, H, 1, hd).to(q.dtype)


class DecodePath(ABC):
    """One decode step's way through the decoder layers: ``tokens`` written at the flat cache positions
    ``slots [B]``, attending the blocks of ``tables [B, n]`` up to ``positions [B]``."""

    def __init__(self, model: Any, plan: StepPlan, cache: PagedKVCache, rot: tuple[Tensor, Tensor],
                 positions: Tensor, slots: Tensor, tables: Tensor, *, silu: bool) -> None:
        self.layer_modules, self.layer_plans = model.model.layers, plan.layers
        self.cache, self.rot, self.positions, self.slots, self.tables = cache, rot, positions, slots, tables
        self.ops, self.silu = plan.step_ops, silu

    def layers(self, x: Tensor) -> Tensor:
        """``x [B, 1, D]`` through every decoder layer -> ``[B, D]``."""
        for li, (layer, lp) in enumerate(zip(self.layer_modules, self.layer_plans, strict=True)):
            x = self.layer(li, layer, lp, x)  # [B, 1, D]
        return x[:, 0]

    @abstractmethod
    def layer(self, li: int, layer: Any, lp: LayerPlan, x: Tensor) -> Tensor:
        """``x [B, 1, D]`` through decoder layer ``li`` -> ``[B, 1, D]``."""


class FusedPagedPath(DecodePath):
    """q and k rotated and k, v written by one op (``pointwise.c``), q going straight to the attention kernel
    over the pool (``attention.c``)."""

    def __init__(self, model: Any, plan: StepPlan, cache: PagedKVCache, rot: tuple[Tensor, Tensor],
                 positions: Tensor, slots: Tensor, tables: Tensor, *, silu: bool) -> None:
        super().__init__(model, plan, cache, rot, positions, slots, tables, silu=silu)
        B, hd = positions.shape[0], cache.head_dim
        self.cos, self.ssin = rot[0].reshape(B, hd), rot[1].reshape(B, hd)  # as the library's ops take them

    def layer(self, li: int, layer: Any, lp: LayerPlan, x: Tensor) -> Tensor:
        cache, hd = self.cache, self.cache.head_dim
        B = x.shape[0]
        fused = lp.qkv(rms_norm(layer.input_layernorm, x, self.ops))[:, 0]  # [B, (H + 2G) * hd]
        q3 = torch.ops.tokenpipe.rope_write(fused, self.cos, self.ssin, cache.kv[li], self.slots,
                                            lp.q_size // hd)  # [B, H, hd]
        o = torch.ops.tokenpipe.paged_attention(q3, cache.k[li], cache.v[li], self.tables, self.positions,
                                                layer.self_attn.scaling)  # [B, H, hd]
        return mlp_block(layer, lp, x + lp.o(o.reshape(B, 1, -1)), self.ops, self.silu)


class StackPath(FusedPagedPath):
    """The decoder layers in one call of the library's ``DecodeStack`` (:mod:`generator.model.stack`): the
    ops of :class:`FusedPagedPath` in the same order, so the same results to the bit."""

    def __init__(self, model: Any, plan: StepPlan, cache: PagedKVCache, rot: tuple[Tensor, Tensor],
                 positions: Tensor, slots: Tensor, tables: Tensor, *, silu: bool, stack: LayerStack,
                 codes: list[int]) -> None:
        super().__init__(model, plan, cache, rot, positions, slots, tables, silu=silu)
        self.stack, self.codes = stack, codes  # codes: each role's kernel at this step's rows

    def layers(self, x: Tensor) -> Tensor:
        return self.stack.step(x[:, 0], self.cos, self.ssin, self.cache.kv, self.slots, self.tables, self.positions,
                               self.codes)  # [B, D]


class _TorchQKV(DecodePath):
    """q, k, v by torch's ops (Qwen3's per-head norms included), k and v written to the pool, then
    :meth:`attend`."""

    def layer(self, li: int, layer: Any, lp: LayerPlan, x: Tensor) -> Tensor:
        cache, ops = self.cache, self.ops
        B = x.shape[0]
        q, k, v = qkv(layer.self_attn, lp, rms_norm(layer.input_layernorm, x, ops), self.rot,
                      cache.head_dim)  # q [B, H, 1, hd]
        if ops and ops_take(k, cache.kv[li]):
            torch.ops.tokenpipe.kv_write(cache.kv[li], k[:, :, 0], v[:, :, 0], self.slots)
        else:
            cache.write(li, k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1), self.slots)
        o = self.attend(li, q, layer.self_attn.scaling)
        x = x + lp.o(o.reshape(B, 1, -1))
        return mlp_block(layer, lp, x, ops, self.silu)

    @abstractmethod
    def attend(self, li: int, q: Tensor, scale: float) -> Tensor:
        """Layer ``li``'s attention of ``q [B, H, 1, hd]`` -> ``[B, H, hd]`` or ``[B, 1, H, hd]``."""


class PagedPath(_TorchQKV):
    """The attention kernel over the pool (``attention.c``) after torch's q/k/v."""

    def attend(self, li: int, q: Tensor, scale: float) -> Tensor:
        out: Tensor = torch.ops.tokenpipe.paged_attention(q[:, :, 0], self.cache.k[li], self.cache.v[li], self.tables,
                                                          self.positions, scale)  # [B, H, hd]
        return out


class GatheredPath(_TorchQKV):
    """K and V gathered from the blocks, then :func:`decode_attention` (fp32 up to ``fp32_rows`` rows)."""

    def __init__(self, model: Any, plan: StepPlan, cache: PagedKVCache, rot: tuple[Tensor, Tensor],
                 positions: Tensor, slots: Tensor, tables: Tensor, *, silu: bool, bias: Tensor) -> None:
        super().__init__(model, plan, cache, rot, positions, slots, tables, silu=silu)
        self.bias, self.fp32_rows = bias, plan.attention_fp32_rows

    def attend(self, li: int, q: Tensor, scale: float) -> Tensor:
        kc, vc = self.cache.gather(li, self.tables)  # [G, B, T, hd]
        return decode_attention(q, kc, vc, self.bias, scale, self.fp32_rows).transpose(1, 2)  # [B, 1, H, hd]


class BaggedPath(_TorchQKV):
    """Only K gathered; ``probs @ V`` by :func:`bagged_attention` over the pool in place."""

    def __init__(self, model: Any, plan: StepPlan, cache: PagedKVCache, rot: tuple[Tensor, Tensor],
                 positions: Tensor, slots: Tensor, tables: Tensor, *, silu: bool, bias: Tensor,
                 bags: tuple[Tensor, Tensor]) -> None:
        super().__init__(model, plan, cache, rot, positions, slots, tables, silu=silu)
        self.bias, self.bags = bias, bags

    def attend(self, li: int, q: Tensor, scale: float) -> Tensor:
        return bagged_attention(q, self.cache, li, self.tables, self.bags, self.bias, scale).transpose(1, 2)


class DecodeAttention:
    """A plan's decode attention backend, chosen once when the plan is built from what the model is.

    :meth:`path` picks one path per step from the step's row count and the plan's measured limits:
    the library's kernel over the pool up to ``paged_attention_rows`` rows (RoPE and the cache write fused
    where the model allows; the whole stack in one call where its kernels serve the step), else torch's
    ops, reading a 16-bit cache in fp32 up to ``attention_fp32_rows`` rows."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        # Qwen3 normalises q and k per head before RoPE: the fused RoPE op cannot take its layers
        self.per_head_norms = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.silu = str(getattr(cfg, "hidden_act", "")) in ("silu", "swish")

    def path(self, model: Any, plan: StepPlan, cache: PagedKVCache, x: Tensor, rot: tuple[Tensor, Tensor],
             positions: Tensor, slots: Tensor, tables: Tensor) -> DecodePath:
        """The path of the step of ``x [B, 1, D]`` (embedded) with the rotary tables ``rot`` (cos and the
        signed sin, ``[B, 1, 1, hd]`` each)."""
        B = x.shape[0]
        args = (model, plan, cache, rot, positions, slots, tables)
        if plan.paged_attention_rows >= B:  # the kernel reads the positions itself: no mask, no bags
            if plan.step_ops and cache.head_dim % 16 == 0 and not self.per_head_norms and \
                    ops_take(x, rot[0], cache.kv[0]):
                stack = plan.stack if plan.stack is not None and plan.stack.dtype == x.dtype else None
                codes = stack.kernels(B) if stack is not None else None
                if stack is not None and codes is not None:
                    return StackPath(*args, silu=self.silu, stack=stack, codes=codes)
                return FusedPagedPath(*args, silu=self.silu)
            return PagedPath(*args, silu=self.silu)
        cols = torch.arange(tables.shape[1] * BLOCK_SIZE, device=positions.device)
        bias = attention_bias(cols[None, :] <= positions[:, None])  # [B, T]
        if plan.attention_fp32_rows >= B:
            return GatheredPath(*args, silu=self.silu, bias=bias)
        return BaggedPath(*args, silu=self.silu, bias=bias, bags=cache.value_bags(tables, self.heads // cache.kv_heads))
