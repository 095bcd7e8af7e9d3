"""Our own kernels for quantized projections on x86 CPUs with AVX2, or AVX-512 (``gemv.c``, ``gemm8.c``).

torch's int4 kernel for the CPU takes bf16 activations and, without AVX-512, converts every
weight to a float before multiplying: at one decode row it streams the weights at well under
the memory's speed (bench/RESULTS.md, "issue 21, part 4"). ``gemv.c`` instead quantizes the
few activation rows to int16 per group of 32 and multiplies 4-bit (or 8-bit) weights as
integers, exactly, scaling each group's sum once, as llama.cpp does with its 8-bit rows (int16
here, so the result stays within ~1e-5 of fp32 instead of a bf16 cast's ~4e-3). A bf16 model's
rows are read and written in bf16 by the kernel itself (no float copies). Where the CPU lists
AVX-512BW (and VNNI), one row's int4 loop takes four groups a step (:func:`build_flags`; AVX2: two);
both read the nibbles with a mask and shifts, without byte shuffles ("issue 21", parts 10 and 15).

For several rows ``gemm8.c`` (the op ``gemm8``) trades that exactness for speed, as llama.cpp does: rows
rounded to int8 per group of 32, four 4-bit weights multiplied per int32 lane by one VNNI instruction,
over a copy of the weights in blocks of output features (:func:`block_q4`, :func:`block_q8`); on AMX
tiles, 16 rows a group per instruction, where the CPU has them (``tiles``).

It is compiled when the engine starts, once per machine, and cached in ``<data dir>/kernels/``
(:func:`load_gemv`); the library registers the ops ``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8`` /
``gemm8``, and the step's other ops for :mod:`generator.forward` (:data:`OTHER_SOURCES`). Where
there is no AVX2/FMA or no compiler the kernels are simply not candidates (logged). Which kernel
serves which row counts is measured like the others (:mod:`generator.kernels`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .kernels import cpu_info

__all__ = ["AMX_FLAGS", "AVX512_FLAGS", "FLAGS", "VNNI_FLAGS", "BlockedWeight", "GemvLib", "Q4Weight", "Q8Weight",
           "block_q4", "block_q8", "build_flags", "load_gemv", "pack_q4", "pack_q8"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
# built alongside: gemm8 (several rows) and the eager forward's other ops (decode attention over the paged pool
# and the cache write; RMSNorm; RoPE with the cache write, SiLU * up)
OTHER_SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemm8.c", "attention.c", "norm.c", "pointwise.c"))
# the fp32/bf16 row helpers the C sources share; the C entry points the C++ calls; the C++'s input checks
HEADERS = tuple(Path(__file__).with_name(n) for n in ("rows.h", "library.h", "checks.h"))
# the torch ops, and the decoder layers of an eager decode step in one call (tokenpipe.DecodeStack)
OP_SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemv_op.cpp", "stack_op.cpp"))
GROUP = 32
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC")  # gemv.c's
# Added where the CPU lists ``avx512bw`` (gemv.c's one-row int4 loop on AVX-512), and VNNI's fused
# multiply-adds with it where listed too. The build's name digests its flags, so a data dir shared
# with a CPU without them builds its own.
AVX512_FLAGS = ("-mavx512f", "-mavx512bw")
VNNI_FLAGS = ("-mavx512vnni",)
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")  # gemm8's tiles, where the CPU lists them (with VNNI)


def build_flags(cpu_flags: list[str] | None) -> tuple[str, ...]:
    """``gemv.c``'s compiler flags for a CPU with ``cpu_flags`` (the AVX2 build without AVX-512)."""
    have = set(cpu_flags or ())
    if "avx512bw" not in have:
        return FLAGS
    if "avx512_vnni" not in have:
        return FLAGS + AVX512_FLAGS
    return FLAGS + AVX512_FLAGS + VNNI_FLAGS + (AMX_FLAGS if {"amx_tile", "amx_int8"} <= have else ())


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


class GemvLib:
    """The built kernel, loaded as the ops ``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def lanes() -> int:
        """The output features per block of ``gemm8.c`` as built here (16 with AVX-512 VNNI, else 8)."""
        return int(torch.ops.tokenpipe.gemm8_lanes())

    @staticmethod
    def tiles() -> bool:
        """Whether ``gemm8`` can run on AMX tiles here (built with them, and Linux granted their state)."""
        return bool(torch.ops.tokenpipe.gemm8_tiles())

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


def _registered() -> bool:
    try:
        torch.ops.tokenpipe.gemv_q4  # noqa: B018 - an op is looked up lazily
    except (AttributeError, RuntimeError):
        return False
    return True


def _unsupported() -> str:
    """Why this machine cannot run the kernel ('' when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    info = cpu_info()
    if info is None:
        return "no /proc/cpuinfo to read the CPU's flags from"
    missing = [f for f in ("avx2", "fma") if f not in info[1]]
    return f"the CPU lacks {', '.join(missing)}" if missing else ""


def load_gemv(data_dir: str | os.PathLike[str]) -> GemvLib | None:
    """The kernel, compiled into ``<data_dir>/kernels/`` if not there yet; None (logged) where it cannot run."""
    why = _unsupported()
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    compiler, cxx_path = shutil.which(cc), shutil.which(cxx)
    if why or compiler is None or cxx_path is None:
        log.info("the gemv kernel is not a candidate here: %s",
                 why or f"no C and C++ compilers ({cc}, {cxx}) on PATH")
        return None
    info = cpu_info()
    flags = build_flags(info[1] if info else None)
    try:
        versions = "".join(subprocess.run([c, "--version"], capture_output=True, text=True, timeout=30).stdout
                           for c in (compiler, cxx_path))
        sources = b"".join(p.read_bytes() for p in (SOURCE, *OTHER_SOURCES, *HEADERS, *OP_SOURCES))
        digest = hashlib.sha256(sources + versions.encode() + " ".join(flags).encode() +
                                torch.__version__.encode()).hexdigest()[:16]
        path = Path(data_dir) / "kernels" / f"gemv-{digest}.so"
        if _registered():  # loaded by an engine built before in this process (one library per process)
            return GemvLib(path)
        if not path.exists():
            log.info("compiling the gemv kernel (once per machine, ~15 s)",
                     extra={"path": str(path), "flags": " ".join(flags)})
            _build(compiler, cxx_path, path, flags)
        torch.ops.load_library(str(path))
        return GemvLib(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("the gemv kernel did not build; the other kernels serve", extra={"error": detail[-2000:]})
        return None


def _build(cc: str, cxx: str, path: Path, flags: tuple[str, ...]) -> None:
    """``gemv.c`` and the other C sources (with ``flags``) and the op bindings (against torch's headers and
    libraries) into ``path``."""
    from torch.utils.cpp_extension import include_paths  # only to build: a slow import

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib = Path(torch.__file__).parent / "lib"

    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)

    objects = [f"{tmp}.{i}.o" for i in range(1 + len(OTHER_SOURCES))]
    cpp_objects = [f"{tmp}.{i}.cpp.o" for i in range(len(OP_SOURCES))]
    # the C++ against torch's headers takes most of the build: its sources compile side by side
    cpp = [subprocess.Popen([cxx, "-O2", "-std=c++20", "-fPIC", abi, *(f"-I{p}" for p in include_paths()), "-c",
                             str(src), "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for src, obj in zip(OP_SOURCES, cpp_objects, strict=True)]
    try:
        try:
            for src, obj in zip((SOURCE, *OTHER_SOURCES), objects, strict=True):
                run(cc, *flags, "-c", str(src), "-o", obj)
        finally:  # a failed C compile still waits for the C++ ones: no compiler left running behind it
            done = [(proc, *proc.communicate(timeout=600)) for proc in cpp]
        for proc, out, err in done:
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        run(cxx, "-shared", "-fopenmp", *cpp_objects, *objects, f"-L{lib}", "-lc10", "-ltorch_cpu", "-lm", "-o",
            str(tmp))
    finally:
        for obj in (*objects, *cpp_objects):
            Path(obj).unlink(missing_ok=True)
    tmp.replace(path)  # atomic: another process never loads half a library
