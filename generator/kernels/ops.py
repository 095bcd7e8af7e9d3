"""The built library's projection kernels as torch ops: ``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8`` (few
rows, ``csrc/gemv.c``) and ``gemm8`` (several rows, ``csrc/gemm8.c``, on AMX tiles where it can).

The library registers them when :func:`generator.kernels.build.load_gemv` loads it; :class:`GemvLib`
runs them on the layouts of :mod:`generator.kernels.formats`. The step's other ops (attention over the
paged pool, RMSNorm, RoPE, SiLU·up, the whole decoder stack) are called by name where they are used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .formats import BlockedWeight, Q4Weight, Q8Weight

__all__ = ["GemvLib"]


class GemvLib:
    """The built kernel, loaded as the ops ``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8``."""

    def __init__(self, path: Path, level: str = "") -> None:
        self.path = path
        self.level = level  # the x86 level it was built for (generator.kernels.levels), '' where unknown

    @staticmethod
    def lanes() -> int:
        """The output features per block of ``gemm8.c`` as built here (16 with AVX-512 VNNI, else 8)."""
        return int(torch.ops.tokenpipe.gemm8_lanes())

    @staticmethod
    def tiles() -> bool:
        """Whether ``gemm8`` can run on AMX tiles here (built with them, and Linux granted their state)."""
        return bool(torch.ops.tokenpipe.gemm8_tiles())

    @staticmethod
    def dequantize(w: Q4Weight | Q8Weight, dtype: torch.dtype) -> Tensor:
        """The weight ``[N, K]`` as floats, bf16 for a bf16 ``dtype``, else fp32 (``csrc/gemv.c``'s one pass)."""
        bf16 = dtype == torch.bfloat16
        if isinstance(w, Q4Weight):
            out: Tensor = torch.ops.tokenpipe.dequant_q4(w.nibbles, w.d, w.m, bf16)
        else:
            out = torch.ops.tokenpipe.dequant_q8(w.q, w.s, bf16)
        return out

    @staticmethod
    def run(x2: Tensor, w: Q4Weight | Q8Weight | BlockedWeight, tiles: bool = False) -> Tensor:
        """``x2 [M, K] -> [M, N]`` in ``x2``'s dtype (computed in fp32); ``tiles``: gemm8 on AMX where it can."""
        if isinstance(w, BlockedWeight):
            out: Tensor = torch.ops.tokenpipe.gemm8(x2, w.w, w.d, w.m, w.bits, w.n, tiles)
        elif isinstance(w, Q4Weight):
            out = torch.ops.tokenpipe.gemv_q4(x2, w.nibbles, w.d, w.m)
        else:
            out = torch.ops.tokenpipe.gemv_q8(x2, w.q, w.s)
        return out
