"""No orphans: a child process that dies with its parent. Its own module, free of tokenpipe's imports,
because ``tokenpipe up`` starts its fork server with it before the command imports anything else."""

from __future__ import annotations

import signal
import sys

__all__ = ["die_with_parent"]


def die_with_parent() -> None:
    """``preexec_fn``: have Linux send SIGTERM to this child when its parent dies (even by SIGKILL),
    so a killed test run or supervisor leaves no orphan servers behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
