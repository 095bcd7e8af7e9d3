"""CPU time and resident memory of another process, from /proc (Linux)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ThreadTimes", "cpu_seconds", "rss_kib", "thread_times"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _user_sys_s(stat: Path) -> tuple[float, float]:
    """User and system CPU seconds from a process's or a thread's ``stat`` (after the command's ``)``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far (clock-tick resolution)."""
    return sum(_user_sys_s(Path(f"/proc/{pid}/stat")))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass(frozen=True)
class ThreadTimes:
    """One thread's CPU seconds so far, and how often it was switched out (waiting, or preempted)."""

    user_s: float
    sys_s: float
    switches: int


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """Each live thread of ``pid``, by thread id (a thread that ends between the reads is left out)."""
    out: dict[int, ThreadTimes] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            user_s, sys_s = _user_sys_s(task / "stat")
            status = (task / "status").read_text().splitlines()
        except OSError:
            continue
        switches = sum(int(line.split()[1]) for line in status
                       if line.split(":")[0] in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        out[int(task.name)] = ThreadTimes(user_s, sys_s, switches)
    return out
