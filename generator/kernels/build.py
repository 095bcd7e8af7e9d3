"""Builds tokenpipe's native kernel library from ``csrc/`` with the system's C and C++ compilers.

torch's int4 kernel for the CPU takes bf16 activations and, without AVX-512, converts every
weight to a float before multiplying: at one decode row it streams the weights at well under
the memory's speed. ``gemv.c`` instead quantizes the
few activation rows to int16 per group of 32 and multiplies 4-bit (or 8-bit) weights as
integers, exactly, scaling each group's sum once, as llama.cpp does with its 8-bit rows (int16
here, so the result stays within ~1e-5 of fp32 instead of a bf16 cast's ~4e-3). A bf16 model's
rows are read and written in bf16 by the kernel itself (no float copies). Where the CPU lists
AVX-512BW (and VNNI), one row's int4 loop takes four groups a step (:func:`build_flags`; AVX2: two);
both read the nibbles with a mask and shifts against activations laid out to match: widening each
group's bytes first took two cross-lane instructions a group and read the weights slower.

For several rows ``gemm8.c`` (the op ``gemm8``) trades that exactness for speed, as llama.cpp does: rows
rounded to int8 per group of 32, four 4-bit weights multiplied per int32 lane by one VNNI instruction,
over a copy of the weights in blocks of output features (:func:`~generator.kernels.formats.block_q4`,
:func:`~generator.kernels.formats.block_q8`); on AMX tiles, 16 rows a group per instruction, where the
CPU has them (``tiles``).

It is compiled when the engine starts, once per machine, and cached in ``<data dir>/kernels/``
(:func:`load_gemv`); the library registers the ops ``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8`` /
``gemm8`` (:mod:`generator.kernels.ops`), and the step's other ops for :mod:`generator.model.forward`
(:data:`OTHER_SOURCES`). Where there is no AVX2/FMA or no compiler the kernels are simply not candidates
(logged). Which kernel serves which row counts is measured like the others
(:mod:`generator.model.kerneltable`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from .cpu import cpu_info
from .ops import GemvLib

__all__ = ["AMX_FLAGS", "AVX512_FLAGS", "FLAGS", "HEADERS", "OP_SOURCES", "OTHER_SOURCES", "SOURCE", "VNNI_FLAGS",
           "build_flags", "load_gemv"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the library's C and C++ sources, shipped as package data
SOURCE = CSRC / "gemv.c"
# built alongside: gemm8 (several rows) and the eager forward's other ops (decode attention over the paged pool
# and the cache write; RMSNorm; RoPE with the cache write, SiLU * up)
OTHER_SOURCES = tuple(CSRC / n for n in ("gemm8.c", "attention.c", "norm.c", "pointwise.c"))
# the fp32/bf16 row helpers the C sources share; the C entry points the C++ calls; the C++'s input checks
HEADERS = tuple(CSRC / n for n in ("rows.h", "library.h", "checks.h"))
# the torch ops, and the decoder layers of an eager decode step in one call (tokenpipe.DecodeStack)
OP_SOURCES = tuple(CSRC / n for n in ("gemv_op.cpp", "stack_op.cpp"))
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
