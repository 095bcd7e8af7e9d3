"""Builds tokenpipe's native kernel library from ``csrc/`` with the system's C and C++ compilers, once per
x86 level (:mod:`generator.kernels.levels`), and loads the one this CPU runs.

torch's int4 kernel for the CPU takes bf16 activations and, without AVX-512, converts every
weight to a float before multiplying: at one decode row it streams the weights at well under
the memory's speed. ``gemv.c`` instead quantizes the
few activation rows to int16 per group of 32 and multiplies 4-bit (or 8-bit) weights as
integers, exactly, scaling each group's sum once, as llama.cpp does with its 8-bit rows (int16
here, so the result stays within ~1e-5 of fp32 instead of a bf16 cast's ~4e-3). A bf16 model's
rows are read and written in bf16 by the kernel itself (no float copies). Where the CPU lists
AVX-512BW (and VNNI), one row's int4 loop takes four groups a step (AVX2: two);
both read the nibbles with a mask and shifts against activations laid out to match: widening each
group's bytes first took two cross-lane instructions a group and read the weights slower.

For several rows ``gemm8.c`` (the op ``gemm8``) trades that exactness for speed, as llama.cpp does: rows
rounded to int8 per group of 32, four 4-bit weights multiplied per int32 lane by one VNNI instruction,
over a copy of the weights in blocks of output features (:func:`~generator.kernels.formats.block_q4`,
:func:`~generator.kernels.formats.block_q8`); on AMX tiles, 16 rows a group per instruction, where the
CPU has them (``tiles``).

**Built ahead of the first start.** ``tokenpipe build-kernels`` (``make install`` runs it; the Docker image's
build stage too) compiles every level into :func:`prebuilt_dir` (``<venv>/share/tokenpipe/kernels``), one
shared object each, named by a digest of the sources, the level's flags and torch's version, plus one of the
compilers' versions: a build whose four inputs have not changed is skipped. The C++ op bindings do not
depend on the level and compile once for all. A file lock serializes builds into one directory, so two
generators starting at once never compile side by side: the second waits and finds the first's object.
:func:`load_gemv` loads the level this CPU runs from there, or from ``<data dir>/kernels/``, compiling only
where neither has it (sources changed since the install, or no build step ran) and a compiler is on PATH;
without one it logs why, once, and torch's kernels serve. The library registers the ops
``torch.ops.tokenpipe.gemv_q4`` / ``gemv_q8`` / ``gemm8`` (:mod:`generator.kernels.ops`), and the step's other
ops for :mod:`generator.model.forward` (:data:`OTHER_SOURCES`). Which kernel serves which row counts is
measured like the others (:mod:`generator.model.kerneltable`).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu import cpu_info
from .levels import AMX_FLAGS, AVX512_FLAGS, FLAGS, VNNI_FLAGS, Level, build_flags, level_for
from .ops import GemvLib

__all__ = ["AMX_FLAGS", "AVX512_FLAGS", "FLAGS", "HEADERS", "OP_SOURCES", "OTHER_SOURCES", "SOURCE", "VNNI_FLAGS",
           "Built", "Toolchain", "build_flags", "build_levels", "find_built", "load_gemv", "object_name",
           "prebuilt_dir", "toolchain", "unsupported"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the library's C and C++ sources, shipped as package data
SOURCE = CSRC / "gemv.c"
# built alongside: gemm8 (several rows) and the eager forward's other ops (decode attention over the paged pool
# and the cache write; RMSNorm; RoPE with the cache write, SiLU * up)
OTHER_SOURCES = tuple(CSRC / n for n in ("gemm8.c", "attention.c", "norm.c", "pointwise.c"))
# the vector width's one abstraction; the fp32/bf16 row helpers the C sources share; the C entry points the
# C++ calls; the C++'s input checks
HEADERS = tuple(CSRC / n for n in ("simd.h", "rows.h", "library.h", "checks.h"))
# the torch ops, and the decoder layers of an eager decode step in one call (tokenpipe.DecodeStack)
OP_SOURCES = tuple(CSRC / n for n in ("gemv_op.cpp", "stack_op.cpp"))
# How long a build waits for another process's build into the same directory: all four levels on a busy
# 2-core machine take well under this; a holder stopped for good (SIGSTOP) must not stop a start for good.
_LOCK_WAIT_S = 600.0


@dataclass(frozen=True)
class Toolchain:
    """The C and C++ compilers a build uses, and a digest of their versions (part of an object's name)."""

    cc: str
    cxx: str
    digest: str


@dataclass(frozen=True)
class Built:
    """One level's object in a build directory: ``fresh`` where this call compiled it (else it was up to date)."""

    level: Level
    path: Path
    fresh: bool


def prebuilt_dir() -> Path:
    """Where ``tokenpipe build-kernels`` puts the objects by default and start-up looks first: beside the
    installed packages (``<venv>/share/tokenpipe/kernels``), so the image's copied venv carries them."""
    return Path(sys.prefix) / "share" / "tokenpipe" / "kernels"


def unsupported() -> str:
    """Why this machine cannot run the library ('' when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    info = cpu_info()
    if info is None:
        return "no /proc/cpuinfo to read the CPU's flags from"
    missing = [f for f in ("avx2", "fma") if f not in info[1]]
    return f"the CPU lacks {', '.join(missing)}" if missing else ""


def toolchain() -> Toolchain | None:
    """The compilers ``$CC`` / ``$CXX`` (default ``cc`` / ``c++``) name, or None where either is not on PATH."""
    cc, cxx = shutil.which(os.environ.get("CC", "cc")), shutil.which(os.environ.get("CXX", "c++"))
    if cc is None or cxx is None:
        return None
    try:
        versions = "".join(subprocess.run([c, "--version"], capture_output=True, text=True, timeout=30).stdout
                           for c in (cc, cxx))
    except (OSError, subprocess.SubprocessError):
        return None
    return Toolchain(cc, cxx, hashlib.sha256(versions.encode()).hexdigest()[:8])


def _source_key(level: Level) -> str:
    """A digest of what the object's code depends on besides the compiler: the sources, the level's flags,
    torch's version (the bindings' ABI). Read without importing torch's build tools or running a compiler,
    so a start without a compiler can still find its prebuilt object."""
    sources = b"".join(p.read_bytes() for p in (SOURCE, *OTHER_SOURCES, *HEADERS, *OP_SOURCES))
    return hashlib.sha256(sources + " ".join(level.flags).encode() + _torch_version().encode()).hexdigest()[:16]


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return torch.__version__


def object_name(level: Level, tools: Toolchain) -> str:
    """The file name of ``level``'s object built by ``tools`` from the sources as they are."""
    return f"tokenpipe-{level.name}-{_source_key(level)}-{tools.digest}.so"


def find_built(level: Level, *dirs: Path) -> Path | None:
    """``level``'s object for the sources as they are, by any compiler, in the first of ``dirs`` holding one."""
    pattern = f"tokenpipe-{level.name}-{_source_key(level)}-*.so"
    for d in dirs:
        found = sorted(d.glob(pattern), key=lambda p: p.stat().st_mtime) if d.is_dir() else []
        if found:
            return found[-1]
    return None


@contextmanager
def _locked(out: Path, say: Callable[[str], None]) -> Iterator[None]:
    """One build at a time into ``out``: an exclusive ``flock`` on ``out/.build.lock``, waited for a bounded time."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".build.lock", "a", encoding="ascii") as fh:
        deadline = time.monotonic() + _LOCK_WAIT_S
        waiting = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    say(f"another process is building the kernels in {out}: waiting for it")
                    waiting = True
                if time.monotonic() > deadline:
                    raise OSError(f"another build held {out / '.build.lock'} over {_LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        yield  # the lock goes with the file's close


def build_levels(out: Path, levels: Sequence[Level], tools: Toolchain,
                 say: Callable[[str], None] = log.info) -> list[Built]:
    """Each of ``levels``' objects in ``out``, compiled where not up to date (under ``out``'s lock: a second
    process waits, then finds them built); ``say`` reports progress. Raises OSError or
    :class:`subprocess.CalledProcessError` (its stderr the compiler's) where a compile fails."""
    with _locked(out, say):
        todo = [lvl for lvl in levels if not (out / object_name(lvl, tools)).exists()]
        for lvl in levels:
            if lvl not in todo:
                say(f"{lvl.name}: up to date ({out / object_name(lvl, tools)})")
        if todo:
            _compile(out, todo, tools, say)
        return [Built(lvl, out / object_name(lvl, tools), lvl in todo) for lvl in levels]


def _compile(out: Path, levels: Sequence[Level], tools: Toolchain, say: Callable[[str], None]) -> None:
    """``levels``' objects into ``out``: the C++ op bindings (against torch's headers, the same for every level)
    once, beside each level's C sources, then one link per level; each object replaces its level's older ones."""
    from torch.utils.cpp_extension import include_paths  # only to build: a slow import

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib = Path(torch.__file__).parent / "lib"
    start = time.monotonic()

    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)

    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        say(f"compiling the native kernels ({', '.join(lvl.name for lvl in levels)}) into {out}: the torch op "
            "bindings once for every level, then each level's C sources")
        cpp_objects = [f"{tmp}/op{i}.o" for i in range(len(OP_SOURCES))]
        # the C++ against torch's headers takes most of the build: its sources compile side by side, and
        # beside the levels' C
        cpp = [subprocess.Popen([tools.cxx, "-O2", "-std=c++20", "-fPIC", abi, *(f"-I{p}" for p in include_paths()),
                                 "-c", str(src), "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for src, obj in zip(OP_SOURCES, cpp_objects, strict=True)]
        objects: dict[str, list[str]] = {}
        try:
            for i, lvl in enumerate(levels, 1):
                t0 = time.monotonic()
                objects[lvl.name] = [f"{tmp}/{lvl.name}-{src.stem}.o" for src in (SOURCE, *OTHER_SOURCES)]
                for src, obj in zip((SOURCE, *OTHER_SOURCES), objects[lvl.name], strict=True):
                    run(tools.cc, *lvl.flags, "-c", str(src), "-o", obj)
                say(f"[{i}/{len(levels)}] {lvl.name}: C sources compiled ({time.monotonic() - t0:.1f} s)")
        finally:  # a failed C compile still waits for the C++ ones: no compiler left running behind it
            done = [(proc, *proc.communicate(timeout=600)) for proc in cpp]
        for proc, stdout, stderr in done:
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
        for lvl in levels:
            path = out / object_name(lvl, tools)
            run(tools.cxx, "-shared", "-fopenmp", *cpp_objects, *objects[lvl.name], f"-L{lib}", "-lc10", "-ltorch_cpu",
                "-lm", "-o", f"{tmp}/{path.name}")
            for old in out.glob(f"tokenpipe-{lvl.name}-*.so"):  # other sources' or compilers' builds
                old.unlink(missing_ok=True)
            os.replace(f"{tmp}/{path.name}", path)  # atomic: another process never loads half a library
            say(f"{lvl.name}: built {path}")
    say(f"kernels built in {time.monotonic() - start:.1f} s")


def _registered() -> bool:
    try:
        torch.ops.tokenpipe.gemv_q4  # noqa: B018 - an op is looked up lazily
    except (AttributeError, RuntimeError):
        return False
    return True


def load_gemv(data_dir: str | os.PathLike[str], prebuilt: Path | None = None) -> GemvLib | None:
    """The library's level for this CPU, from ``prebuilt`` (default :func:`prebuilt_dir`) or
    ``<data_dir>/kernels/``, compiled into the latter if neither has it; None (logged) where it cannot run."""
    why = unsupported()
    if why:
        log.info("the gemv kernel is not a candidate here: %s", why)
        return None
    info = cpu_info()
    level = level_for(info[1] if info else None)
    cache = Path(data_dir) / "kernels"
    try:
        path = find_built(level, prebuilt or prebuilt_dir(), cache)
        if path is None:
            tools = toolchain()
            if tools is None:
                log.info("the gemv kernel is not a candidate here: no prebuilt %s build and no C and C++ compilers "
                         "(%s, %s) on PATH; torch's kernels serve (`tokenpipe build-kernels` where there is one)",
                         level.name, os.environ.get("CC", "cc"), os.environ.get("CXX", "c++"))
                return None
            path = cache / object_name(level, tools)
            if not _registered() and not path.exists():  # compiled under the lock, unless another start did it
                built = build_levels(cache, [level], tools)[0]
                if built.fresh:
                    log.info("the native kernels were compiled at start: `tokenpipe build-kernels` (make install) "
                             "builds them ahead", extra={"path": str(built.path), "level": level.name})
        if _registered():  # loaded by an engine built before in this process (one library per process)
            return GemvLib(path, level.name)
        torch.ops.load_library(str(path))
        log.info("native kernels loaded", extra={"path": str(path), "level": level.name})
        return GemvLib(path, level.name)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("the native kernels did not build or load; torch's kernels serve", extra={"error": detail[-2000:]})
        return None
