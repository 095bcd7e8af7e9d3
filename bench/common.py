"""What the benchmarks share: the machine's line, the figures' output, percentiles, alternation,
another process's CPU and memory, and the chat prompts every phase sends.

Nothing here imports torch or the product's roles: :mod:`bench.suite` lists the scenarios with it
without loading a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from tokenpipe_cli.stats import percentile

__all__ = ["OUT_DIR", "TOPICS", "alternate", "chat", "cpu_seconds", "cpu_summary", "pct", "rss_kib", "write_json"]

OUT_DIR = Path(__file__).with_name("out")
"""Where every benchmark writes its JSON by default (``bench/out/``, ignored by git)."""

_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
_TICKS = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


def cpu_summary() -> dict[str, Any]:
    """The CPU model, core count and the vector flags that decide the kernels (from /proc/cpuinfo)."""
    model, flags = "unknown CPU", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in _FLAGS if f in flags]
    cores = os.cpu_count() or 0
    return {"model": model, "cores": cores, "flags": have,
            "line": f"{model}, {cores} CPUs, {' '.join(have) or 'no AVX2'}"}


def write_json(path: str | Path, data: Any, indent: int = 2) -> Path:
    """``data`` as JSON at ``path``, its directory made first; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=indent))
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of unsorted ``values``."""
    return percentile(sorted(values), q / 100)


def alternate(items: Sequence[T], round_no: int) -> list[T]:
    """``items`` in order on even rounds and reversed on odd ones: variants timed in turn on a shared
    machine then see its drift alike, the first slot of a round going to each in turn."""
    return list(items) if round_no % 2 == 0 else list(reversed(items))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds another process has used so far (clock-tick resolution, from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_kib(pid: int) -> int:
    """A process's resident memory now, KiB (from /proc; 0 where the kernel does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


TOPICS = ["a lighthouse", "the moon", "a robot", "coffee", "rivers", "a library", "winter", "trains", "bees",
          "the ocean", "a violin", "mountains", "a city at night", "gardens", "a storm", "friendship"]


def chat(i: int) -> list[dict[str, str]]:
    """The benchmarks' ``i``-th request: a short chat on one of :data:`TOPICS`, the same in every phase."""
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})."}]
