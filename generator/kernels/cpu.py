"""The CPU this process runs on, as ``/proc/cpuinfo`` names it: which kernels can be built and what a
measured kernel table was measured on."""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_info"]


def cpu_info() -> tuple[str, list[str]] | None:
    """The CPU's model name and flags from ``/proc/cpuinfo``; None where there is none to read."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith(("flags", "Features"))), [])
    return name or platform.machine(), flags
