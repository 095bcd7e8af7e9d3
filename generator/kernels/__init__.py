"""The native kernels layer: tokenpipe's C/C++ kernel library (``csrc/``), how it is built for this CPU, the
quantized weight layouts its kernels read, and the torch ops it registers. Imports nothing else of the
generator."""

from .build import load_gemv
from .cpu import cpu_info
from .formats import BlockedWeight, Q4Weight, Q8Weight
from .ops import GemvLib

__all__ = ["BlockedWeight", "GemvLib", "Q4Weight", "Q8Weight", "cpu_info", "load_gemv"]
