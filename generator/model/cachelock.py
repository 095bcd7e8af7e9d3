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

__all__ = ["CacheLock", "one_at_a_time"]

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


class CacheLock:
    """The same lock taken without waiting, held until :meth:`release`: for work done in pieces between
    other work (the kernel table measured in the background, :mod:`generator.model.tuning`), where waiting
    is polling. Without a writable data dir every :meth:`try_take` succeeds (there is no cache to share)."""

    def __init__(self, path: Path) -> None:
        self.path = path.with_suffix(".lock")
        self._fh: Any = None
        self.held = False

    def try_take(self) -> bool:
        """Whether this process holds the lock now (taken here, or already)."""
        if self.held:
            return True
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a", encoding="ascii")  # noqa: SIM115 - held until release()
        except OSError as exc:
            log.warning("no lock for %s; going on without one", self.path, extra={"error": str(exc)})
            self.held = True
            return True
        self.held = _try_lock(self._fh)
        return self.held

    def release(self) -> None:
        """Let go (closing the file lets the ``flock`` go); safe to call again."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.held = False


def _try_lock(fh: Any) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
