"""The quantized weight layouts the library's kernels read (``csrc/gemv.c``, ``csrc/gemm8.c``).

``gemv.c`` reads a 4-bit weight as nibbles with a scale and an offset per group of 32 inputs
(:class:`Q4Weight`, the GGUF Q4_1 form) or an 8-bit one with a scale per output row (:class:`Q8Weight`);
``gemm8.c`` reads either copied into blocks of output features (:class:`BlockedWeight`, :func:`block_q4`,
:func:`block_q8`), so that one VNNI instruction multiplies four weights of a lane.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GROUP", "BlockedWeight", "Q4Weight", "Q8Weight", "block_q4", "block_q8", "pack_q4", "pack_q8"]

GROUP = 32  # inputs per quantization group (the GGUF file's block)


@dataclass(frozen=True)
class Q4Weight:
    """``w[n, k] = q * d[n, g] + m[n, g]`` (g = k // 32): ``nibbles [N, K/2]`` uint8, byte j of a
    group holding q[j] (low) and q[j + 16] (high); ``d``, ``m`` ``[N, K/32]`` fp32."""

    nibbles: Tensor
    d: Tensor
    m: Tensor

    def dequantize(self) -> Tensor:
        """``[N, K]`` fp32 (tests)."""
        lo, hi = (self.nibbles & 0x0F), (self.nibbles >> 4)
        n, g = self.d.shape
        q = torch.cat([lo.view(n, g, 16), hi.view(n, g, 16)], -1).float()
        return (q * self.d[..., None] + self.m[..., None]).view(n, g * GROUP)


@dataclass(frozen=True)
class Q8Weight:
    """``w[n, k] = q[n, k] * s[n]``: ``q [N, K]`` int8, ``s [N]`` fp32."""

    q: Tensor
    s: Tensor


@dataclass(frozen=True)
class BlockedWeight:
    """A :class:`Q4Weight` or :class:`Q8Weight` in ``gemm8.c``'s layout: blocks of ``lanes`` output
    features, ``w [blocks, G * lanes * bits * 4]`` uint8, ``d``, ``m`` ``[blocks, G, lanes]`` fp32;
    ``n`` output features (the last block's padding is zero)."""

    w: Tensor
    d: Tensor
    m: Tensor
    bits: int
    n: int


def _blocks(t: Tensor, lanes: int) -> Tensor:
    """``t [N, ...]`` zero-padded to a multiple of ``lanes`` rows, as ``[blocks, lanes, ...]``."""
    pad = -t.shape[0] % lanes
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, lanes, *t.shape[1:])


def block_q4(w: Q4Weight, lanes: int) -> BlockedWeight:
    """``w`` for ``gemm8.c``: a group's byte 4c + t (q[4c + t] low, q[16 + 4c + t] high, as :func:`pack_q4`
    stores them) goes to chunk c, after the same bytes of the block's features before it."""
    n, half = w.nibbles.shape
    g = half // 16
    nib = _blocks(w.nibbles, lanes).view(-1, lanes, g, 4, 4).permute(0, 2, 3, 1, 4)  # [blocks, G, c, lane, t]
    d, m = (_blocks(t, lanes).transpose(1, 2).contiguous() for t in (w.d, w.m))
    return BlockedWeight(nib.reshape(nib.shape[0], -1).contiguous(), d, m, 4, n)


def block_q8(w: Q8Weight, lanes: int) -> BlockedWeight:
    """``w`` for ``gemm8.c``: ``q + 128`` as unsigned bytes (the offset comes back through ``m``), weight
    4c + t of a group in chunk c."""
    n, k = w.q.shape
    g = k // GROUP
    u = (w.q.to(torch.int16) + 128).to(torch.uint8)
    blocks = _blocks(u, lanes).view(-1, lanes, g, 8, 4).permute(0, 2, 3, 1, 4)
    d = _blocks(w.s[:, None].expand(n, g), lanes).transpose(1, 2).contiguous()
    return BlockedWeight(blocks.reshape(blocks.shape[0], -1).contiguous(), d, -128 * d, 8, n)


def pack_q4(q: Tensor, scale: Tensor, zero: Tensor) -> Q4Weight:
    """From ``q [N, K]`` in 0..15 and ``scale``, ``zero`` ``[N, K/32]`` with ``w = (q - 8) * scale + zero``."""
    n, k = q.shape
    qg = q.to(torch.uint8).view(n, k // GROUP, GROUP)
    nibbles = (qg[..., :16] | (qg[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    d = scale.float().contiguous()
    return Q4Weight(nibbles, d, (zero.float() - 8 * d).contiguous())


def pack_q8(q: Tensor, s: Tensor) -> Q8Weight:
    """From ``q [N, K]`` int8 and ``s [N]`` with ``w = q * s``."""
    return Q8Weight(q.contiguous(), s.float().contiguous())
