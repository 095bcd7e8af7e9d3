"""Weight-only quantization of the projections: int8 per output row, int4 in groups of 32.

The matmuls run in torch's own kernels: ``_weight_int8pack_mm`` and, for int4,
``_weight_int4pack_mm_for_cpu`` on the CPU and ``_weight_int4pack_mm`` (tinygemm) on CUDA.
These kernels are fast only with 16-bit activations (their fp32 path is a scalar
fallback), so a quantized projection casts its input to bf16 and its output back to the
model's dtype; norms, attention and the KV cache keep the model's dtype.

int4 uses asymmetric groups of 32 along the input dimension, the layout of the GGUF file the
default model comes from (Q4_1: ``w = q * d + m`` per block of 32), so re-quantizing its
de-quantized layers gives back the file's own 4-bit values. Its output layer is 8-bit in the
file (Q8_0), and ``lm_head`` is int8 under int4 too (:func:`generator.model.plan.build_plan`).

Which kernel serves a projection at a given number of rows (the quantized one, the float
weight, or the float weight pre-packed for oneDNN) is measured at start-up
(:mod:`generator.model.kerneltable`, :mod:`generator.model.autotune`); :data:`DENSE_ROWS` and
:data:`BF16_DENSE_ROWS` are the rule that measurement starts from (and the ``rules`` setting).

Where a kernel is missing or fails its start-up check (an old GPU, a torch build
without it), the projection uses the float weight it keeps (or, built without one,
de-quantizes on the fly) and a warning says so.
"""

from __future__ import annotations

import logging
from typing import Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenpipe.errors import InvalidRequest
from tokenpipe.settings import Quant

from ..kernels.formats import GROUP, BlockedWeight, Q4Weight, Q8Weight, block_q4, block_q8, pack_q4, pack_q8
from ..kernels.ops import GemvLib
from .kerneltable import Band, kernel_for, pack_weight, packed_linear

__all__ = ["BF16_DENSE_ROWS", "DENSE_ROWS", "QUANT_MODES", "QuantLinear", "QuantMode", "check_quant",
           "dense_rows_for", "quantize_weight", "resolve_quant"]

log = logging.getLogger(__name__)

QuantMode = Literal["none", "int8", "int4"]
QUANT_MODES: tuple[str, ...] = get_args(Quant)  # defined once, with the setting
# Matmuls of more rows than this (a prefill) use the float weight the model keeps: the
# quantized kernels pay off where a matmul reads more weight than it computes (decode), and
# lose where it computes (prefill). So quantization here trades memory (+1/7 of fp32 for
# int4) for speed.
DENSE_ROWS = 32
# With native bf16 (AVX512-BF16) the bf16 GEMM overtakes the int4 kernel already at about 20
# rows (measured on such a CPU): there the float weight serves matmuls of more than 16 rows, so
# a few streams decode at int4's speed and many at bf16's.
BF16_DENSE_ROWS = 16
_INNER_K_TILES = 8  # tinygemm's packing parameter (CUDA); the CPU packer accepts and ignores it
_CHECK_ROWS = 256  # rows of a weight its kernel check compares (QuantLinear._kernel_ok)


def check_quant(mode: str) -> str:
    """Validate a ``--quant`` value (``auto`` included)."""
    if mode not in QUANT_MODES:
        raise InvalidRequest(f"unknown quant {mode!r}; use {', '.join(QUANT_MODES)}", param="quant")
    return mode


def resolve_quant(mode: str, *, from_4bit: bool, device: torch.device, native_bf16: bool) -> QuantMode:
    """``auto``: int4 on a CPU for weights that came from a 4-bit file (the default model's GGUF,
    which int4 gives back exactly); otherwise none.

    On a CPU int4 decodes one stream about twice as fast as the float weight; other weights would
    lose precision. On CUDA neither kernel pays (a batch-1 step is launch-bound), so ``auto`` keeps
    it unquantized."""
    mode = check_quant(mode)
    if mode != "auto":
        return cast(QuantMode, mode)
    return "int4" if from_4bit and device.type == "cpu" else "none"


def dense_rows_for(dtype: torch.dtype, *, native_bf16: bool) -> int:
    """Above how many rows a quantized projection uses the float weight the model keeps."""
    return BF16_DENSE_ROWS if dtype == torch.bfloat16 and native_bf16 else DENSE_ROWS


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as int8 or packed int4; a drop-in for ``nn.Linear``."""

    def __init__(self, weight: Tensor, bias: Tensor | None, mode: QuantMode, dense_rows: int = DENSE_ROWS,
                 verdicts: dict[tuple[str, str, int, int], bool] | None = None) -> None:
        """``verdicts``: the kernel checks already made for this model, by (mode, device, shape); a
        kernel that works for one layer of a shape works for every one of it (each check de-quantizes
        its weight: 121 of them were a second of SmolLM2's start)."""
        super().__init__()
        if mode == "none":
            raise ValueError("QuantLinear needs int8 or int4")
        self.mode = mode
        # The float weight (shared with the model, not copied) serves matmuls of more than
        # ``dense_rows`` rows, where the quantized kernels are slower (see DENSE_ROWS).
        self.dense = weight.detach() if dense_rows > 0 else None
        # The kernel per row band (generator.model.kerneltable): set by the start-up measurement; until then
        # the rule above (quantized up to ``dense_rows`` rows, the float weight beyond).
        self.bands: tuple[Band, ...] = ((dense_rows, "quant"),)
        self.packed: Tensor | None = None  # the float weight pre-packed for oneDNN, where the table uses it
        # The weight in generator.kernels.formats' layout (CPU), and that kernel once loaded (generator.model.autotune)
        self.gemv: Q4Weight | Q8Weight | None = None
        self.gemv_lib: GemvLib | None = None
        self.blocked: BlockedWeight | None = None  # the same in gemm8's layout, where the table uses it
        self.out_features, self.in_features = weight.shape
        self.act_dtype = torch.bfloat16
        self.bias = None if bias is None else bias.detach().clone()
        w = weight.detach().float()
        gemv_ok = w.device.type == "cpu" and self.in_features % GROUP == 0
        if mode == "int8":
            qweight, scales = _quant_int8(w)
            self.gemv = pack_q8(qweight, scales) if gemv_ok else None
        else:
            if self.in_features % GROUP:
                raise InvalidRequest(f"int4 needs input sizes divisible by {GROUP}; this layer has {self.in_features}")
            q, scales = _quant_int4(w)  # q [N, K] int32 in 0..15; scales [K/G, N, 2] (scale, zero)
            self.q_unpacked = q
            qweight = _pack_int4(q, w.device)
            self.gemv = pack_q4(q, scales[..., 0].T, scales[..., 1].T) if gemv_ok else None
        # torch's kernel's copy (None once dropped: drop_torch_weight)
        self.qweight: Tensor | None = qweight
        self.scales: Tensor | None = scales.to(self.act_dtype)
        verdicts = {} if verdicts is None else verdicts
        key = (mode, str(w.device), self.out_features, self.in_features)
        if key not in verdicts:
            verdicts[key] = self._kernel_ok(w)
        self.fallback = not verdicts[key]
        if self.fallback:
            log.warning("no working %s kernel on %s here: the float weights serve instead", mode, w.device.type)
        elif mode == "int4":
            del self.q_unpacked  # the packed form is all the kernel needs

    @classmethod
    def from_q4(cls, w: Q4Weight, dense_rows: int = DENSE_ROWS) -> QuantLinear:
        """An int4 projection of the library's weight ``w`` as it is (a GGUF's ``Q4_1`` blocks): no float weight
        and no torch copy (its ``quant`` bands run ``gemv``); the library must serve it (``gemv_lib``)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.mode, self.dense, self.packed, self.blocked = "int4", None, None, None
        self.bands = ((dense_rows, "quant"),)
        self.gemv, self.gemv_lib = w, None
        self.out_features, self.in_features = w.nibbles.shape[0], w.nibbles.shape[1] * 2
        self.act_dtype, self.bias = torch.bfloat16, None
        self.qweight = self.scales = None
        self.fallback = False
        return self

    def _kernel(self, x: Tensor) -> Tensor:
        assert self.qweight is not None and self.scales is not None  # dropped only where this is not called
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP, self.scales)
        return torch.ops.aten._weight_int4pack_mm(x, self.qweight, GROUP, self.scales)

    def _kernel_ok(self, w: Tensor) -> bool:
        """The kernel agrees with the de-quantized weight on a small input (catches missing or broken kernels)."""
        x = torch.randn(2, self.in_features, device=w.device, dtype=self.act_dtype)
        try:
            got = self._kernel(x).float()
        except (RuntimeError, NotImplementedError) as exc:
            log.debug("quant kernel failed its check", exc_info=exc)
            return False
        # Against a sample of the weight's rows: de-quantizing all of a vocabulary-sized lm_head (113 MB of
        # fp32 for SmolLM2's) was a tenth of a second of every start, and a broken kernel errs on every row.
        rows = torch.unique(torch.linspace(0, self.out_features - 1, min(self.out_features, _CHECK_ROWS),
                                           device=w.device).long())
        ref = x.float() @ self.dequantize(rows).T
        got = got[:, rows]
        return bool(((got - ref).norm() <= 0.02 * ref.norm() + 1e-3).item())

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """The weight as the kernel sees it, ``[N, K]`` fp32 (tests, the fallback); ``rows``: those rows only,
        ``[len(rows), K]``, de-quantizing no others where torch's copy is kept."""
        if self.scales is None or self.qweight is None:
            if isinstance(self.gemv, Q4Weight):
                whole = self.gemv.dequantize()
                return whole if rows is None else whole[rows]
            raise RuntimeError("torch's copy of the quantized weight was dropped")
        pick = slice(None) if rows is None else rows
        s = self.scales.float()
        if self.mode == "int8":
            return self.qweight[pick].float() * s[pick, None]
        if not hasattr(self, "q_unpacked"):
            raise RuntimeError("the int4 weight is packed; its unpacked form was not kept")
        scale, zero = s[..., 0].T[pick], s[..., 1].T[pick]  # [n, K/G]
        qg = self.q_unpacked[pick].float().view(scale.shape[0], -1, GROUP)
        return ((qg - 8) * scale[..., None] + zero[..., None]).view(scale.shape[0], self.in_features)

    def drop_torch_weight(self) -> bool:
        """Free torch's packed copy of the quantized weight (~0.6 bytes a weight with its bf16 scales) where the
        library's kernel holds its own and can stand in for it; False (kept) where it cannot."""
        if self.fallback or self.gemv is None or self.gemv_lib is None:
            return False
        self.qweight = self.scales = None
        return True

    def release_float(self) -> bool:
        """Let go of the float weight (and its packed copy) where the library can make it again for a call
        from the quantized weight; False (kept) where it cannot. The caller drops the model's own references
        (:func:`generator.model.plan.release_float_weights`)."""
        if self.fallback or self.gemv is None or self.gemv_lib is None:
            return False
        self.dense = self.packed = None
        return True

    def pack(self) -> bool:
        """Pre-pack the float weight for oneDNN (once); False where that is not possible here."""
        if self.packed is None and self.dense is not None:
            self.packed = pack_weight(self.dense)
        return self.packed is not None

    def block(self) -> bool:
        """Copy the quantized weight into ``gemm8``'s layout (once); False where that kernel is not built here."""
        if self.blocked is None and self.gemv is not None and self.gemv_lib is not None:
            lanes = self.gemv_lib.lanes()
            self.blocked = block_q4(self.gemv, lanes) if isinstance(self.gemv, Q4Weight) else block_q8(self.gemv, lanes)
        return self.blocked is not None

    def run(self, x2: Tensor, kernel: str) -> Tensor:
        """``x2 [M, K] -> [M, N]`` (no bias) on ``kernel`` (``quant``, ``dense``, ``packed``, ``gemv``, ``gemm8``,
        ``amx``: gemm8 on AMX tiles) where it can."""
        if self.dense is None and self.gemv is not None and self.gemv_lib is not None and not self.fallback and \
                kernel in ("dense", "packed"):
            # The float weight let go (release_float, from_q4): made for this call. Not gemm8 instead: its
            # int8 rows, fine for decode, turned a 37-token SmolLM2 prefill's answer to nonsense.
            return F.linear(x2, self.gemv_lib.dequantize(self.gemv, x2.dtype).to(x2.dtype))
        if kernel in ("gemm8", "amx"):
            if self.block():
                assert self.gemv_lib is not None and self.blocked is not None
                return self.gemv_lib.run(x2, self.blocked, tiles=kernel == "amx")  # no tiles: gemm8's loop
            kernel = "quant"  # not built here (logged at start): the other quantized kernel
        if kernel == "quant" and self.qweight is None:
            kernel = "gemv"  # torch's copy was dropped (no band uses it, :meth:`drop_torch_weight`)
        if kernel == "gemv":
            if self.gemv is not None and self.gemv_lib is not None:
                return self.gemv_lib.run(x2, self.gemv)
            kernel = "quant"  # not built here (logged at start): the other quantized kernel
        if kernel == "packed" and self.packed is not None:
            return packed_linear(x2.to(self.packed.dtype), self.packed, None).to(x2.dtype)
        if self.dense is not None and (self.fallback or kernel != "quant"):
            return F.linear(x2, self.dense)
        if self.fallback:
            return F.linear(x2.float(), self.dequantize()).to(x2.dtype)
        return self._kernel(x2.to(self.act_dtype)).to(x2.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self.run(x2, kernel_for(self.bands, x2.shape[0]))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.mode}{' (fallback)' if self.fallback else ''}"


def _quant_int8(w: Tensor, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-row int8: ``w ≈ q * s``. Rows in chunks: the temporaries of a whole vocabulary-sized
    lm_head (~4 fp32 copies, ~450 MB for SmolLM2's) were the start's peak of memory."""
    s = torch.cat([w[i:i + chunk].abs().amax(1) for i in range(0, w.shape[0], chunk)]).clamp(min=1e-8) / 127
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    inv = 1 / s
    for i in range(0, w.shape[0], chunk):
        q[i:i + chunk] = (w[i:i + chunk] * inv[i:i + chunk, None]).round_().clamp_(-127, 127)
    return q, s


def _quant_int4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Asymmetric groups of 32 along K: ``w ≈ (q - 8) * scale + zero`` (tinygemm's convention)."""
    N, K = w.shape
    wg = w.reshape(N, K // GROUP, GROUP)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).reshape(N, K)
    zero = lo + 8 * scale
    sz = torch.stack([scale.reshape(N, -1), zero.reshape(N, -1)], -1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return q, sz


def _pack_int4(q: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INNER_K_TILES)
    # tinygemm (CUDA, sm80+) takes two 4-bit values per byte
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), _INNER_K_TILES)


def quantize_weight(weight: Tensor, bias: Tensor | None, mode: QuantMode, dense_rows: int = DENSE_ROWS,
                    verdicts: dict[tuple[str, str, int, int], bool] | None = None) -> nn.Module:
    """A module computing ``F.linear(x, weight, bias)``: the plain weight for ``none``, else quantized
    (``verdicts``: :class:`QuantLinear`'s)."""
    if mode == "none":
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    return QuantLinear(weight, bias, mode, dense_rows, verdicts)
