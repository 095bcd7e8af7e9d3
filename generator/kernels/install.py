"""``tokenpipe build-kernels``: the native library built ahead of the first start, every x86 level, with
progress, into the directory start-up looks in first (:func:`~generator.kernels.build.prebuilt_dir`).

``make install`` runs it after pip installs the generator; the Docker image's build stage runs it with
``--strict`` and the runtime stage copies what it wrote. Up-to-date levels are skipped (their objects are
named by a digest of sources, flags, compiler and torch versions), and a build already under way in the
same directory is waited for, not repeated.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .build import build_levels, prebuilt_dir, toolchain, unsupported
from .cpu import cpu_info
from .levels import LEVELS, level_named

__all__ = ["build_kernels"]


def _say(line: str) -> None:
    print(f"tokenpipe build-kernels: {line}", file=sys.stderr, flush=True)


def build_kernels(out: str | Path | None = None, levels: Sequence[str] = (), strict: bool = False) -> int:
    """Build ``levels`` (names; default all) into ``out`` (default the prebuilt directory), reporting progress
    on stderr and one line per level on stdout (``name<TAB>built|up to date<TAB>path<TAB>runs here: yes|no``).
    Returns the exit status: 1 where a compile failed, or (``strict``) where nothing could be built here."""
    target = Path(out) if out is not None else prebuilt_dir()
    chosen = [level_named(n) for n in levels] if levels else list(LEVELS)
    # a CPU without AVX2 still builds the levels for others (an image's build machine); only x86-64 builds at all
    why = "" if platform.machine().lower() in ("x86_64", "amd64") else f"not an x86-64 CPU ({platform.machine()})"
    tools = toolchain()
    if why or tools is None:
        _say(f"nothing built: {why or 'no C and C++ compilers (cc, c++; or $CC, $CXX) on PATH'}; "
             "the generator serves with torch's kernels")
        return 1 if strict else 0
    try:
        built = build_levels(target, chosen, tools, _say)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        _say(f"the build failed: {detail[-3000:]}")
        return 1
    info = cpu_info()
    for b in built:
        runs = "yes" if info is not None and not unsupported() and b.level.runs_on(info[1]) else "no"
        print(f"{b.level.name}\t{'built' if b.fresh else 'up to date'}\t{b.path}\truns here: {runs}")
    return 0
