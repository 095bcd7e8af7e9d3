"""Run a command as on a CPU with fewer vector extensions than this one: a stand-in for the CPU models
issue 21 asks about when only a bigger one is at hand.

    python -m bench.ascpu avx2 -- python -m bench.stepsplit --rows 1,8,32
    python -m bench.ascpu avx512-bf16 -- python -m bench.peers --servers tokenpipe --concurrency 32

What decides the kernels sees only the profile's extensions:

- ``/proc/cpuinfo`` loses the other flags, in a private mount namespace of the command (``unshare``;
  root only), so everything that reads it (tokenpipe's kernel library build flags, its ``auto``
  dtype and quantization, the kernel table's cache key, every process the command starts) agrees;
- torch's own kernels are capped by their documented switches: ATen's ``ATEN_CPU_CAPABILITY``,
  oneDNN's ``ONEDNN_MAX_CPU_ISA``, MKL's ``MKL_ENABLE_INSTRUCTIONS``.

The cores, caches and memory stay this machine's: a figure measured so holds for this CPU running
that instruction set, not for the CPU model it stands in for (a benchmark's CPU line names this CPU's
model with the profile's flags). llama.cpp, to compare with, is built for the profile apart
(``bench.peers --llama-python``): for ``avx2`` with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"``, for ``avx512-bf16`` with :mod:`bench.peers`' AMX-off flags.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PROFILES", "Profile", "masked_cpuinfo", "missing", "run_as", "unavailable"]


@dataclass(frozen=True)
class Profile:
    """The CPU flags a profile hides and the environment that caps torch's kernels to match."""

    name: str
    stands_for: str
    needs: tuple[str, ...]  # flags the CPU must have: a profile hides extensions, it cannot add them
    hide: str  # a regular expression over whole flag names
    env: dict[str, str] = field(default_factory=dict)


PROFILES = {p.name: p for p in (
    Profile("avx2", "an AVX2-only x86 CPU (AMD EPYC Zen 2/3)", ("avx2", "fma"),
            r"avx512\w*|amx\w*|avx_vnni\w*|avx_ifma|avx_ne_convert",
            {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    Profile("avx512-bf16", "AVX-512 with BF16 and VNNI but no AMX (AMD EPYC Zen 4)",
            ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"),
            r"amx\w*|avx512_fp16|avx_vnni\w*|avx_ifma|avx_ne_convert",
            {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
)}


def masked_cpuinfo(text: str, profile: Profile) -> str:
    """``/proc/cpuinfo``'s text with the profile's hidden flags taken off every ``flags`` line."""
    hidden = re.compile(rf"(?:{profile.hide})")
    out = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            line = f"{key}: " + " ".join(f for f in value.split() if not hidden.fullmatch(f))
        out.append(line)
    return "\n".join(out) + "\n"


def missing(profile: Profile, cpuinfo: str) -> list[str]:
    """The flags ``profile`` needs that the first ``flags`` line of ``cpuinfo`` lacks."""
    have = next((v.split() for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())
                 if k.strip() == "flags"), [])
    return [f for f in profile.needs if f not in have]


def unavailable() -> str | None:
    """Why flags cannot be hidden here (None: they can): it takes root, ``unshare(1)`` and a kernel that
    grants a private mount namespace (a container without ``CAP_SYS_ADMIN`` does not)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "hiding CPU flags needs root and unshare(1) (a private mount namespace over /proc/cpuinfo)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"no private mount namespace here: {probe.stderr.strip() or f'unshare exited {probe.returncode}'}"
    return None


def run_as(profile: Profile, command: list[str]) -> int:
    """Run ``command`` under ``profile`` and return its exit status (2 with a reason where it cannot)."""
    reason = unavailable()
    if reason is not None:
        print(f"bench.ascpu: {reason}", file=sys.stderr)
        return 2
    real = Path("/proc/cpuinfo").read_text()
    lacking = missing(profile, real)
    if lacking:
        print(f"bench.ascpu: this CPU lacks {' '.join(lacking)}: it cannot run as {profile.stands_for}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ascpu-") as tmp:
        fake = Path(tmp) / "cpuinfo"
        fake.write_text(masked_cpuinfo(real, profile))
        env = {**os.environ, **profile.env}
        print(f"bench.ascpu: as {profile.stands_for}: flags /{profile.hide}/ hidden, "
              + " ".join(f"{k}={v}" for k, v in profile.env.items()), file=sys.stderr, flush=True)
        # mount's exit ends the shell before the command runs: nothing runs with the flags showing
        script = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(fake),
                               *command], env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.ascpu", description=__doc__.splitlines()[0])
    ap.add_argument("profile", choices=sorted(PROFILES))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given (bench.ascpu PROFILE -- COMMAND ...)")
    return run_as(PROFILES[args.profile], command)


if __name__ == "__main__":
    sys.exit(main())
