"""A compact Llama-family forward pass over the paged KV cache (gpt-fast style).

The weights and the norm/MLP/rotary modules are the transformers model's own; only
attention is ours, so that every sequence in a batch keeps its own position and a
sequence can join or leave the batch between steps without touching the others.

K/V live in :class:`~generator.kvcache.PagedKVCache` blocks: each step writes the new
positions through a flat slot index and reads each row's blocks through its block table.
Shape legend: B rows, S prompt length, T attended length (table width × block size),
D model dim, H heads, G kv heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kvcache import BLOCK_SIZE, PagedKVCache
from .quant import DENSE_ROWS, QuantMode, quantize_weight
from .stack import LayerStack

__all__ = ["FP32_ATTENTION_ROWS", "Plan", "attention_bias", "build_plan", "decode_step", "plan_for", "prefill"]

FP32_ATTENTION_ROWS = 2  # by rule, decode steps of at most this many rows read a 16-bit KV cache in fp32

@dataclass
class _LayerPlan:
    qkv: nn.Module  # [q; k; v] in one matmul
    o: nn.Module
    gate_up: nn.Module  # [gate; up] in one matmul
    down: nn.Module
    q_size: int
    kv_size: int
    inter: int


@dataclass
class Plan:
    """The projections as the forward runs them: fused, and quantized when asked."""

    layers: list[_LayerPlan]
    lm_head: nn.Module
    quant: QuantMode
    # decode steps of at most this many rows read a 16-bit KV cache in fp32 (generator.kernels measures it)
    attention_fp32_rows: int = FP32_ATTENTION_ROWS
    # decode steps of at most this many rows take attention.c's kernel over the pool (0: the torch ops)
    paged_attention_rows: int = 0
    # the eager decode step's RMSNorm, RoPE with the cache write, and SiLU(gate) * up through the library's
    # ops (norm.c, pointwise.c; attention.c's cache write) where it is loaded
    step_ops: bool = False
    # with step_ops, the decoder layers of a step in one call where every projection runs the library's kernels
    # (generator/stack.py)
    stack: LayerStack | None = None

    def projections(self, role: str) -> list[nn.Module]:
        """The plan's modules of one role (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``)."""
        if role == "lm_head":
            return [self.lm_head]
        return [getattr(lp, role) for lp in self.layers]


_PLANS: WeakKeyDictionary[nn.Module, Plan] = WeakKeyDictionary()


def _fuse(mods: list[Any], quant: QuantMode, dense_rows: int = DENSE_ROWS) -> nn.Module:
    """One projection for ``mods`` stacked along the output. The originals become views into
    the fused float weight (no second copy; the model's own forward still works)."""
    weight = torch.cat([m.weight for m in mods])
    biases = [m.bias for m in mods]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("cannot fuse projections where only some have a bias")
    start = 0
    for m in mods:
        stop = start + m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return quantize_weight(weight, bias, quant, dense_rows)


def build_plan(model: Any, quant: QuantMode = "none", dense_rows: int = DENSE_ROWS) -> Plan:
    """Fuse (and quantize) the model's projections once, after it is on its device.

    Quantized, the plan's projections hold the quantized weights and keep the float ones for
    many-row matmuls (a prefill: see :mod:`generator.quant`); ``lm_head`` is int8 (the
    embedding it may be tied to is untouched). The model's own modules and forward are unchanged.
    """
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], quant, dense_rows)
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj], quant, dense_rows)
        o, down = (quantize_weight(m.weight, m.bias, quant, dense_rows) if quant != "none" else m
                   for m in (attn.o_proj, mlp.down_proj))
        q_size, kv_size, inter = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], mlp.gate_proj.weight.shape[0]
        layers.append(_LayerPlan(qkv, o, gate_up, down, q_size, kv_size, inter))
    lm_head = model.lm_head
    if quant != "none":
        # lm_head stays at 8 bits under int4, as in the GGUF the default model comes from (its output is
        # Q8_0, its layers Q4_1): 4 bits cost it far more accuracy (RESULTS.md, "Weight-only quantization").
        lm_head = quantize_weight(model.lm_head.weight, model.lm_head.bias, "int8", dense_rows)
    plan = Plan(layers, lm_head, quant)
    _PLANS[model] = plan
    return plan


def plan_for(model: Any) -> Plan:
    """The model's plan, built (fused, unquantized) on first use."""
    return _PLANS.get(model) or build_plan(model)


def _ops_take(*ts: Tensor) -> bool:
    """Whether the library's small ops take these tensors: one dtype, fp32 or bf16."""
    return ts[0].dtype in (torch.float32, torch.bfloat16) and all(t.dtype == ts[0].dtype for t in ts)


def _rms_norm(norm: Any, x: Tensor, ops: bool = False) -> Tensor:
    """``norm(x)`` for the model's RMSNorm (Llama, Qwen3) in one ATen call instead of the module's
    seven ops from Python: normalised in fp32, cast back, times the weight, as the module computes it.
    With ``ops``, one call of the library's op (``norm.c``: 1.3-4x fewer µs than torch's at 1-32 rows)."""
    weight, eps = norm.weight, norm.variance_epsilon
    if ops and _ops_take(x, weight):
        out: Tensor = torch.ops.tokenpipe.rms_norm(x, weight, eps)
        return out
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotary(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per step, the rotary tables as :func:`_rope` reads them: ``cos/sin [B, S, hd]`` ->
    ``[B, S, 1, hd]`` each, ``sin``'s first half negated (what ``rotate_half`` did per call)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)


def _rope(x: Tensor, rot: tuple[Tensor, Tensor]) -> Tensor:
    """``x [B, S, n, hd]`` rotated: ``x·cos + rotate_half(x)·sin``, where ``rotate_half(x)·sin``
    is ``x`` with its halves swapped (a roll) times the signed sine: three ops, not eight."""
    cos, signed_sin = rot
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _qkv(attn: Any, lp: _LayerPlan, h: Tensor, rot: tuple[Tensor, Tensor],
         hd: int) -> tuple[Tensor, Tensor, Tensor]:
    B, S, _ = h.shape
    qkv = lp.qkv(h)  # [B, S, (H + 2G) * hd]
    v = qkv[..., lp.q_size + lp.kv_size:].view(B, S, -1, hd).transpose(1, 2)  # [B, G, S, hd]
    if hasattr(attn, "q_norm"):  # Qwen3 normalises q/k per head before RoPE
        q, k = qkv[..., :lp.q_size].view(B, S, -1, hd), qkv[..., lp.q_size:lp.q_size + lp.kv_size].view(B, S, -1, hd)
        return _rope(attn.q_norm(q), rot).transpose(1, 2), _rope(attn.k_norm(k), rot).transpose(1, 2), v
    # q and k rotated together: they sit side by side in the fused projection's output
    qk = _rope(qkv[..., :lp.q_size + lp.kv_size].view(B, S, -1, hd), rot)  # [B, S, H + G, hd]
    heads = lp.q_size // hd
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v  # [B, H, S, hd], [B, G, S, hd]


def _mlp_block(layer: Any, lp: _LayerPlan, x: Tensor, ops: bool = False, silu: bool = False) -> Tensor:
    """With ``ops`` and ``silu`` (the model's act_fn is SiLU), the activation is the library's one op."""
    gate_up = lp.gate_up(_rms_norm(layer.post_attention_layernorm, x, ops))
    if ops and silu and _ops_take(gate_up) and lp.inter % 8 == 0:
        return x + lp.down(torch.ops.tokenpipe.silu_mul(gate_up))
    gate, up = gate_up.split([lp.inter, lp.inter], dim=-1)
    return x + lp.down(layer.mlp.act_fn(gate) * up)


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
    rot = _rotary(*inner.rotary_emb(x, positions))  # cos/sin [N, S, hd]
    flat_slots = slots.reshape(-1)
    mask = None
    if tables is not None:
        cols = torch.arange(tables.shape[1] * BLOCK_SIZE, device=input_ids.device)
        mask = (cols[None, None, :] <= positions[:, :, None])[:, None]  # [N, 1, S, T]
    for li, (layer, lp) in enumerate(zip(inner.layers, plan.layers, strict=True)):
        attn = layer.self_attn
        q, k, v = _qkv(attn, lp, _rms_norm(layer.input_layernorm, x), rot, cache.head_dim)  # k, v [N, G, S, hd]
        cache.write(li, k.permute(1, 0, 2, 3).reshape(k.shape[1], N * S, -1),
                    v.permute(1, 0, 2, 3).reshape(v.shape[1], N * S, -1), flat_slots)
        if tables is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        else:
            kc, vc = cache.gather(li, tables)  # [G, N, T, hd]
            o = F.scaled_dot_product_attention(q, kc.transpose(0, 1), vc.transpose(0, 1), attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=True)
        x = x + lp.o(o.transpose(1, 2).reshape(N, S, -1))  # [N, S, D]
        x = _mlp_block(layer, lp, x)
    last = x[torch.arange(N, device=x.device), lengths - 1]  # [N, D]: only these rows need logits
    return plan.lm_head(_rms_norm(inner.norm, last))  # [N, V]


def attention_bias(mask: Tensor) -> Tensor:
    """``mask [B, T]`` (True = attend) as the additive fp32 bias the decode attention takes,
    ``[B, T]`` of 0 and -inf: built once per step, so a layer adds it in the op that scales."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float,
                      fp32_rows: int = FP32_ATTENTION_ROWS) -> Tensor:
    """Single-query attention with grouped KV heads.

    In bf16, two small batched matmuls: for one query token several times faster on CPU than
    SDPA's flash kernel with a mask, and no repeat of K/V per query head. In fp32 on CPU, SDPA
    (GQA, the bias as its mask), where the matmul path's eight ops cost more in dispatch than in
    arithmetic (bench/RESULTS.md, "The other half of the step"). A bf16 cache is read in fp32 for up to
    ``fp32_rows`` rows (:data:`FP32_ATTENTION_ROWS` by rule, else the plan's measured figure,
    :mod:`generator.kernels`): CPU bf16 matmuls this small cost more than the cast.
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


def _bagged_attention(q: Tensor, cache: PagedKVCache, layer: int, tables: Tensor, bags: tuple[Tensor, Tensor],
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


@torch.inference_mode()
def decode_step(model: Any, cache: PagedKVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
                tables: Tensor) -> Tensor:
    """One token for each row: ``tokens [B]`` at ``positions [B]``, K/V written at the flat cache
    positions ``slots [B]``; attention reads the blocks of ``tables [B, n]`` (padded with the
    scratch block; a fixed ``n`` keeps every shape static). Returns ``[B, V]``.

    Attention takes the plan's kernel over the pool up to its ``paged_attention_rows``; RMSNorm, RoPE
    with the cache write and SiLU(gate) * up the library's ops where the plan has them (``step_ops``;
    a prefill's many rows take torch's vectorized ones); with those, where the plan has a stack and every layer
    projection's kernel at ``B`` rows is the library's, the decoder layers are one call (:mod:`generator.stack`,
    the same results to the bit).
    """
    inner, plan = model.model, plan_for(model)
    B = tokens.shape[0]
    x = inner.embed_tokens(tokens[:, None])  # [B, 1, D]
    rot = _rotary(*inner.rotary_emb(x, positions[:, None]))  # cos/sin [B, 1, hd]
    paged = plan.paged_attention_rows >= B
    ops = plan.step_ops
    fp32_rows = plan.attention_fp32_rows
    hd = cache.head_dim
    # q and k rotated and k, v written by one op, q going straight to the attention kernel (not Qwen3's
    # per-head norms before RoPE)
    rope_op = paged and ops and hd % 16 == 0 and not hasattr(inner.layers[0].self_attn, "q_norm") and \
        _ops_take(x, rot[0], cache.kv[0])
    cos, ssin = rot[0].reshape(B, hd), rot[1].reshape(B, hd)
    silu = str(getattr(model.config, "hidden_act", "")) in ("silu", "swish")
    bias: Tensor | None = None  # the torch ops' mask and value bags; the kernel reads positions itself
    bags: tuple[Tensor, Tensor] | None = None
    if not paged:
        cols = torch.arange(tables.shape[1] * BLOCK_SIZE, device=tokens.device)
        bias = attention_bias(cols[None, :] <= positions[:, None])  # [B, T]
        bags = None if fp32_rows >= B else cache.value_bags(
            tables, int(model.config.num_attention_heads) // cache.kv_heads)
    stack = plan.stack if rope_op and plan.stack is not None and plan.stack.dtype == x.dtype else None
    codes = stack.kernels(B) if stack is not None else None
    if stack is not None and codes is not None:  # generator/stack_op.cpp: the ops below in one call
        x2 = stack.step(x[:, 0], cos, ssin, cache.kv, slots, tables, positions, codes)  # [B, D]
        return plan.lm_head(_rms_norm(inner.norm, x2, ops))  # [B, V]
    for li, (layer, lp) in enumerate(zip(inner.layers, plan.layers, strict=True)):
        attn = layer.self_attn
        if rope_op:  # generator/pointwise.c, then attention.c
            qkv = lp.qkv(_rms_norm(layer.input_layernorm, x, ops))[:, 0]  # [B, (H + 2G) * hd]
            q3 = torch.ops.tokenpipe.rope_write(qkv, cos, ssin, cache.kv[li], slots, lp.q_size // hd)  # [B, H, hd]
            o = torch.ops.tokenpipe.paged_attention(q3, cache.k[li], cache.v[li], tables, positions, attn.scaling)
            x = _mlp_block(layer, lp, x + lp.o(o.reshape(B, 1, -1)), ops, silu)
            continue
        q, k, v = _qkv(attn, lp, _rms_norm(layer.input_layernorm, x, ops), rot, hd)  # q [B, H, 1, hd]
        if ops and _ops_take(k, cache.kv[li]):
            torch.ops.tokenpipe.kv_write(cache.kv[li], k[:, :, 0], v[:, :, 0], slots)
        else:
            cache.write(li, k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1), slots)
        if paged:  # straight from the pool (generator/attention.c)
            o = torch.ops.tokenpipe.paged_attention(q[:, :, 0], cache.k[li], cache.v[li], tables, positions,
                                                    attn.scaling)  # [B, H, hd]
        elif bags is None and bias is not None:
            kc, vc = cache.gather(li, tables)  # [G, B, T, hd]
            o = _decode_attention(q, kc, vc, bias, attn.scaling, fp32_rows).transpose(1, 2)  # [B, 1, H, hd]
        elif bags is not None and bias is not None:
            o = _bagged_attention(q, cache, li, tables, bags, bias, attn.scaling).transpose(1, 2)
        x = x + lp.o(o.reshape(B, 1, -1))
        x = _mlp_block(layer, lp, x, ops, silu)
    return plan.lm_head(_rms_norm(inner.norm, x[:, 0], ops))  # [B, V]
