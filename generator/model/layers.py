"""One decoder layer's parts as the forward runs them: its fused projections (:class:`LayerPlan`) and the
RMSNorm, RoPE, q/k/v split and MLP around attention.

The weights and the norm/MLP/rotary modules are the transformers model's own; these functions
call them with fewer ops than the modules' own forward (one ATen call for a norm, three ops for
RoPE), or, with ``ops``, the library's ops (``generator/kernels/csrc/norm.c``, ``pointwise.c``).
Shape legend: B rows, S positions a row, D model dim, H heads, G kv heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerPlan", "mlp_block", "ops_take", "qkv", "rms_norm", "rope", "rotary"]


@dataclass
class LayerPlan:
    """One decoder layer's projections as the forward runs them: fused, and quantized when asked."""

    qkv: nn.Module  # [q; k; v] in one matmul
    o: nn.Module
    gate_up: nn.Module  # [gate; up] in one matmul
    down: nn.Module
    q_size: int
    kv_size: int
    inter: int


def ops_take(*ts: Tensor) -> bool:
    """Whether the library's small ops take these tensors: one dtype, fp32 or bf16."""
    return ts[0].dtype in (torch.float32, torch.bfloat16) and all(t.dtype == ts[0].dtype for t in ts)


def rms_norm(norm: Any, x: Tensor, ops: bool = False) -> Tensor:
    """``norm(x)`` for the model's RMSNorm (Llama, Qwen3) in one ATen call instead of the module's
    seven ops from Python: normalised in fp32, cast back, times the weight, as the module computes it.
    With ``ops``, one call of the library's op (``norm.c``: 1.3-4x fewer µs than torch's at 1-32 rows)."""
    weight, eps = norm.weight, norm.variance_epsilon
    if ops and ops_take(x, weight):
        out: Tensor = torch.ops.tokenpipe.rms_norm(x, weight, eps)
        return out
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotary(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per step, the rotary tables as :func:`rope` reads them: ``cos/sin [B, S, hd]`` ->
    ``[B, S, 1, hd]`` each, ``sin``'s first half negated (what ``rotate_half`` did per call)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)


def rope(x: Tensor, rot: tuple[Tensor, Tensor]) -> Tensor:
    """``x [B, S, n, hd]`` rotated: ``x·cos + rotate_half(x)·sin``, where ``rotate_half(x)·sin``
    is ``x`` with its halves swapped (a roll) times the signed sine: three ops, not eight."""
    cos, signed_sin = rot
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def qkv(attn: Any, lp: LayerPlan, h: Tensor, rot: tuple[Tensor, Tensor], hd: int) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's q, k (rotated) and v of ``h [B, S, D]``: ``[B, H, S, hd]``, ``[B, G, S, hd]`` twice."""
    B, S, _ = h.shape
    fused = lp.qkv(h)  # [B, S, (H + 2G) * hd]
    v = fused[..., lp.q_size + lp.kv_size:].view(B, S, -1, hd).transpose(1, 2)  # [B, G, S, hd]
    if hasattr(attn, "q_norm"):  # Qwen3 normalises q/k per head before RoPE
        q = fused[..., :lp.q_size].view(B, S, -1, hd)
        k = fused[..., lp.q_size:lp.q_size + lp.kv_size].view(B, S, -1, hd)
        return rope(attn.q_norm(q), rot).transpose(1, 2), rope(attn.k_norm(k), rot).transpose(1, 2), v
    # q and k rotated together: they sit side by side in the fused projection's output
    qk = rope(fused[..., :lp.q_size + lp.kv_size].view(B, S, -1, hd), rot)  # [B, S, H + G, hd]
    heads = lp.q_size // hd
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v  # [B, H, S, hd], [B, G, S, hd]


def mlp_block(layer: Any, lp: LayerPlan, x: Tensor, ops: bool = False, silu: bool = False) -> Tensor:
    """``x`` plus the layer's MLP of its post-attention norm. With ``ops`` and ``silu`` (the model's act_fn
    is SiLU), the activation is the library's one op."""
    gate_up = lp.gate_up(rms_norm(layer.post_attention_layernorm, x, ops))
    if ops and silu and ops_take(gate_up) and lp.inter % 8 == 0:
        return x + lp.down(torch.ops.tokenpipe.silu_mul(gate_up))
    gate, up = gate_up.split([lp.inter, lp.inter], dim=-1)
    return x + lp.down(layer.mlp.act_fn(gate) * up)
