"""The kernel table: which kernel serves each projection, per row band, chosen by measurement at start-up
and cached per machine.

Which kernel serves a decode projection fastest depends on the CPU, not only on its flags: on an
AVX2-only CPU tokenpipe's own kernel won almost every band, on one with AVX-512 and BF16 only the
first one or two rows, where torch's int4 kernel and oneDNN's pre-packed bf16 weight took the rest, at
crossings no hand threshold predicted. So instead of hand thresholds, the engine's own thread
times each candidate on the model's real projections (the fused q/k/v, o, gate/up, down and
the LM head) at the row counts decode runs, builds a table of row bands per projection,
confirms the changed choices with whole decode steps, and caches the table in the data dir
under a key of CPU model, flags, cores, threads, torch version and model.

Candidates: ``quant`` (torch's int4/int8 kernel), ``dense`` (the float weight the model keeps),
``packed`` (that weight pre-packed once for oneDNN, ``torch.ops.mkldnn._reorder_linear_weight``,
kept only for the roles whose bands use it), ``gemv`` (our AVX2/AVX-512 kernel with int16 rows over its
own copy of the quantized weight, :mod:`generator.kernels`, kept wherever that kernel can run), ``gemm8``
(ours with int8 rows, over that weight blocked by output feature: kept only for the roles that use it)
and ``amx`` (gemm8 on AMX tiles, where the CPU has them: the same blocked weight, the same results).
int8 beside int4 and fp32 beside a bf16 model are not candidates: each would keep another copy
of the weights. The default is today's rule (:func:`rule_table`); a measured kernel replaces it
only when it is at least :data:`MARGIN` faster.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from ..kernels.cpu import cpu_info

__all__ = ["FAMILY_KERNELS", "KERNEL_CHOICES", "MARGIN", "ROW_COUNTS", "Band", "KernelTable", "bands_from",
           "cache_key", "choose", "kernel_for", "pack_weight", "packed_linear", "row_counts", "rule_table",
           "rules_kernel", "timed"]

log = logging.getLogger(__name__)

Kernel = Literal["quant", "dense", "packed", "gemv", "gemm8", "amx"]
KERNEL_CHOICES: tuple[str, ...] = get_args(Kernel)
ROW_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32)  # the decode batch sizes measured (rows between take the next one's)
ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
MARGIN = 0.10  # a measured kernel replaces the default only when this much faster
TABLE_VERSION = 5  # 2: the gemv kernel is a candidate; 3: the paged attention kernel; 4: gemm8 and amx;
# 5: steps through the stack (generator/model/stack.py) confirm the library's kernels

Band = tuple[int, str]  # (up to this many rows, kernel)


# -- the band logic (pure) ------------------------------------------------------------------
def row_counts(max_batch: int) -> tuple[int, ...]:
    """The row counts to measure for an engine of ``max_batch`` rows (``max_batch`` itself included)."""
    counts = [r for r in ROW_COUNTS if r <= max_batch]
    if max_batch not in counts:
        counts.append(max_batch)
    return tuple(counts)


def choose(times: Mapping[str, float], default: str) -> str:
    """The fastest kernel in ``times`` (seconds) if it beats ``default`` by :data:`MARGIN` or more, else ``default``."""
    best = min(times, key=lambda k: times[k])
    if default not in times or times[best] <= times[default] * (1 - MARGIN):
        return best
    return default


def bands_from(choices: Mapping[int, str]) -> tuple[Band, ...]:
    """Row bands from a choice per measured row count: consecutive counts with the same kernel merge,
    each band reaching up to its last count (rows between two counts take the upper one's kernel)."""
    bands: list[Band] = []
    for rows in sorted(choices):
        kernel = choices[rows]
        if bands and bands[-1][1] == kernel:
            bands[-1] = (rows, kernel)
        else:
            bands.append((rows, kernel))
    return tuple(bands)


def kernel_for(bands: Iterable[Band], rows: int) -> str:
    """The kernel of the first band that reaches ``rows``; more rows than any band (a prefill) use ``dense``."""
    for upto, kernel in bands:
        if rows <= upto:
            return kernel
    return "dense"


# -- the table ------------------------------------------------------------------------------
@dataclass
class KernelTable:
    """Row bands per projection role, plus up to how many decode rows attention reads a 16-bit cache in fp32
    and up to how many it takes the kernel over the paged pool (``generator/kernels/csrc/attention.c``; 0 where
    not built)."""

    bands: dict[str, tuple[Band, ...]]
    attention_fp32_rows: int
    source: str = "rules"  # rules | measured | cache | override
    seconds: float = 0.0  # what measuring it cost
    times_us: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # role -> rows -> kernel -> µs
    steps_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # rows -> variant -> decode step ms
    paged_attention_rows: int = 0

    def to_json(self, key: Mapping[str, Any]) -> str:
        return json.dumps({"version": TABLE_VERSION, "key": dict(key), "table": asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, key: Mapping[str, Any]) -> KernelTable | None:
        """The table in ``text`` if it was made for ``key``; None for another key. Raises ValueError if malformed."""
        try:
            raw = json.loads(text)
            if raw.get("version") != TABLE_VERSION or raw.get("key") != dict(key):
                return None
            body = raw["table"]
            bands = {str(role): tuple((int(u), str(k)) for u, k in rows) for role, rows in body["bands"].items()}
            table = cls(bands=bands, attention_fp32_rows=int(body["attention_fp32_rows"]), source="cache",
                        seconds=float(body.get("seconds", 0.0)), times_us=body.get("times_us", {}),
                        steps_ms=body.get("steps_ms", {}),
                        paged_attention_rows=int(body.get("paged_attention_rows", 0)))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed kernel table: {exc}") from exc
        if set(bands) != set(ROLES) or any(k not in KERNEL_CHOICES for b in bands.values() for _, k in b):
            raise ValueError("malformed kernel table: unknown roles or kernels")
        return table

    def summary(self) -> str:
        """The table in one line: each role's bands (``qkv: ≤16 quant, ≤32 packed; o: …``), then attention's."""
        return "; ".join(f"{role}: " + ", ".join(f"≤{u} {k}" for u, k in self.bands[role]) for role in ROLES) + \
            "; attention: " + self._attention()

    def _attention(self) -> str:
        paged, fp32 = self.paged_attention_rows, self.attention_fp32_rows
        kernel = f"kernel ≤{paged} rows" if paged else ""
        torch_fp32 = f"fp32 ≤{fp32} rows" if fp32 > paged else ""
        return ", ".join(p for p in (kernel, torch_fp32) if p) or "native"


# The rules' quantized kernel per level of tokenpipe's library (generator.kernels.levels), where a CPU family's
# measured tables agree: on the AVX2-only EPYC every band of every projection measured ``gemm8`` (or ``gemv`` at
# one row, within the margin), and under torch's ``quant`` one stream decoded at 47 tok/s against 108 (issue 49:
# a first start served that until its table was measured, 13 s of idle later). Elsewhere ``quant``.
FAMILY_KERNELS: dict[str, Kernel] = {"avx2": "gemm8"}


def rules_kernel(level: str) -> Kernel:
    """The rules' quantized kernel where tokenpipe's library serves at ``level`` ('': it does not)."""
    return FAMILY_KERNELS.get(level, "quant")


def rule_table(counts: Iterable[int], dense_rows: int, *, quantized: bool, attention_fp32_rows: int,
               forced: str = "", paged_attention_rows: int = 0, level: str = "") -> KernelTable:
    """Today's hand rules as a table (the quantized kernel up to ``dense_rows`` rows: ``level``'s in
    :data:`FAMILY_KERNELS`, where tokenpipe's library serves at that level, else ``quant``; then ``dense``),
    or every decode row count on the ``forced`` kernel (the override)."""
    quant = rules_kernel(level)
    choices = {r: forced or (quant if quantized and r <= dense_rows else "dense") for r in counts}
    bands = bands_from(choices)
    return KernelTable({role: bands for role in ROLES}, attention_fp32_rows, source="override" if forced else "rules",
                       paged_attention_rows=paged_attention_rows)


# -- the cache key --------------------------------------------------------------------------
def _cpu() -> tuple[str, str]:
    """The CPU's model name and a digest of its flags (the platform's name without ``/proc/cpuinfo``)."""
    info = cpu_info()
    if info is None:
        return platform.processor() or platform.machine(), ""
    name, flags = info
    return name, hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]


def cache_key(model: str, quant: str, dtype: torch.dtype, counts: Iterable[int], *, threads: int | None = None,
              cpu: tuple[str, str] | None = None, gemv: str = "", float_weights: bool = True) -> dict[str, Any]:
    """What a measured table depends on: CPU model and flags, cores, threads, torch, model, quant, dtype, rows,
    which build of the gemv kernel was a candidate (``gemv``: its file's name, '' without one), and whether
    the projections kept their float weights (without, ``dense`` costs a de-quantization a call)."""
    name, flags = cpu or _cpu()
    extra = {} if float_weights else {"float_weights": False}  # the keys of tables measured before stay valid
    return {**extra, "cpu": name, "flags": flags, "cores": os.cpu_count() or 1, "gemv": gemv,
            "threads": threads if threads is not None else torch.get_num_threads(), "torch": torch.__version__,
            "model": model, "quant": quant, "dtype": str(dtype).removeprefix("torch."), "rows": list(counts)}


def cache_file(data_dir: str | os.PathLike[str], key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:20]
    return Path(data_dir) / "kernels" / f"{digest}.json"


# -- pre-packed weights ---------------------------------------------------------------------
def pack_weight(weight: Tensor) -> Tensor | None:
    """``weight [N, K]`` reordered once into oneDNN's blocked layout (CPU, bf16/fp32), or None where this
    torch build cannot (the plain weight is then reordered by oneDNN on every call)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or \
            not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        x = torch.randn(2, weight.shape[1], dtype=weight.dtype)
        ok = torch.allclose(packed_linear(x, packed, None).float(), (x @ weight.T).float(), rtol=0.05, atol=0.05)
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.debug("no pre-packed linear weights here", exc_info=exc)
        return None
    return packed if ok else None


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x [M, K] @ W.T (+ bias)`` with a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# -- timing ---------------------------------------------------------------------------------
def timed(variants: Mapping[str, Callable[[], object]], *, rounds: int = 7, min_s: float = 0.001) -> dict[str, float]:
    """Seconds per call of each variant: rounds alternate the variants; a round repeats a call until
    ``min_s`` passed; the fastest round counts (a shared machine's interference only ever adds time:
    with the lower quartile, 5 rounds still let a 30 µs projection read 5 ms here)."""
    per: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up: first-call allocation, oneDNN primitive creation
    for _ in range(rounds):
        for name, fn in variants.items():
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= min_s:
                    break
            per[name].append(elapsed / n)
    return {name: min(v) for name, v in per.items()}
