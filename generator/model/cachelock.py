"""One process at a time fills a cache beside a path: a converted model, a measured kernel table.

Generators started together on one data dir would otherwise do the same slow work side by side (and,
for the kernel table, measure while the others load: slow kernels picked), or write through the same
temporary directory. The first takes an exclusive ``flock`` on ``<path>.lock``; the others wait, then
find its result. A holder stopped for good (SIGSTOP) is waited for a bounded time only.
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["one_at_a_time"]

log = logging.getLogger(__name__)

# How long a start waits for another process's measurement or conversion: two measurements on a loaded
# 2-core machine take well under this; a holder stopped for longer (SIGSTOP) must not stop this start for good.
_LOCK_WAIT_S = 300.0


@contextmanager
def one_at_a_time(path: Path, doing: str) -> Iterator[None]:
    """Hold an exclusive lock beside ``path``, a cache that one process at a time fills (the kernel
    table: see the module docstring; a converted model), ``doing`` saying how in the log. A holder
    stopped for good is waited for a bounded time. Without a writable data dir there is no lock
    (nor a cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path.with_suffix(".lock"), "a", encoding="ascii")  # noqa: SIM115 - held across the yield
    except OSError as exc:
        log.warning("no lock for %s; going on without one", doing, extra={"path": str(path), "error": str(exc)})
        yield
        return
    with fh:
        if not _try_lock(fh):
            log.info("another process is %s; waiting for its result", doing, extra={"path": str(path)})
            deadline = time.monotonic() + _LOCK_WAIT_S
            while not _try_lock(fh):
                if time.monotonic() > deadline:
                    log.warning("the process %s held its lock over %.0f s; going on without it", doing,
                                _LOCK_WAIT_S, extra={"path": str(path)})
                    break
                time.sleep(0.2)
        yield  # the lock goes with the file's close


def _try_lock(fh: Any) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
