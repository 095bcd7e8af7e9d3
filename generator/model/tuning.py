"""The kernel table measured in the background: a generator serves at once and measures between steps.

Measured at start-up (:func:`generator.model.autotune.tune_plan`), the table kept a fresh generator from
serving for tens of seconds on 2 cores; two generators on one data dir measured it one after the other,
and a busy machine's measurement was thrown away after both attempts, all before the first token. Now a start
that finds no cached table applies the rules (:func:`~generator.model.kerneltable.rule_table`) and
serves; the engine thread measures whenever it has nothing to step (the runner calls
:meth:`BackgroundTuning.step` while the engine is idle), one unit at a time
(:func:`~generator.model.autotune.measure_steps`: one role at one row count, or one set of confirming
steps), applying the serving table again after each, so a request that arrives meanwhile waits at most
one unit and is served under the rules. When the measurement ends its table is cached, applied and
logged ("kernel table (measured) replaces the rules").

One process measures per cache key: it takes the lock beside the cache file without waiting
(:class:`~generator.model.cachelock.CacheLock`); a process that finds it held serves the rules and looks for
the holder's table every :data:`POLL_S`, applying it when it appears (a holder stopped for good: after
``lock_wait_s`` it measures itself). A measurement begins once other processes left the CPUs alone
for :data:`QUIET_S` (a second generator still loading its model made the first one's measurement
untrusted, and was slowed by it), or after ``quiet_wait_s`` anyway. Other processes' CPU use is added
up over the measuring spells only
(a request served between them is this process's own); a table measured while they held more than
:data:`~generator.model.autotune.BUSY_SHARE` of the machine is neither applied nor cached, measured again
after ``retry_s`` (unless another process cached its table meanwhile: looked for every :data:`POLL_S`), at
most ``attempts`` times in a row, then the rules serve the run (a later start measures again). The pause and
the count are the data dir's, not the process's (``<key>.untrusted`` beside the cache file, written under the
lock): the generators of one ``tokenpipe up`` on a busy machine took turns, each measuring 3 times.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from .autotune import (
    BUSY_SHARE,
    OthersLoad,
    Tunable,
    apply_table,
    measure_steps,
    prepare_plan,
    read_cache,
    release_freed_memory,
    write_cache,
)
from .cachelock import CacheLock
from .kerneltable import KernelTable
from .plan import Plan

__all__ = ["ATTEMPTS", "POLL_S", "QUIET_S", "QUIET_WAIT_S", "RETRY_S", "BackgroundTuning", "tune_in_background"]

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a process that waits for another's table looks for it
RETRY_S = 60.0  # after an untrusted measurement (a busy machine), this long before the next
ATTEMPTS = 3  # measurements in one run, untrusted ones included
QUIET_S = 1.0  # how long others' CPU use is watched before a measurement begins
QUIET_WAIT_S = 120.0  # how long a measurement waits for the others to leave the CPUs before it begins anyway
_LOCK_WAIT_S = 300.0  # a holder stopped for longer (SIGSTOP) no longer keeps this process on the rules
_CHAIN_S = 300.0  # untrusted measurements this far apart (beyond the pause) are not one run's attempts in a row


class BackgroundTuning:
    """The measurement of one plan's kernel table, run in pieces on the engine thread (see the module
    docstring). ``table`` is the table that serves now; ``measurements`` counts the measurements this
    process finished (trusted or not)."""

    def __init__(self, model: Any, plan: Plan, tunable: Tunable, *, dtype: torch.dtype, name: str,
                 busy_share: float | None = BUSY_SHARE, retry_s: float = RETRY_S, attempts: int = ATTEMPTS,
                 lock_wait_s: float = _LOCK_WAIT_S, quiet_wait_s: float = QUIET_WAIT_S) -> None:
        assert tunable.key is not None and tunable.path is not None, "a plan whose table is measured"
        self.model, self.plan, self.dtype, self.name = model, plan, dtype, name
        self.rules, self.counts = tunable.rules, tunable.counts
        self.key: dict[str, Any] = tunable.key
        self.path: Path = tunable.path
        self.busy_share, self.retry_s, self.attempts, self.lock_wait_s = busy_share, retry_s, attempts, lock_wait_s
        self.quiet_wait_s = quiet_wait_s
        self._quiet: OthersLoad | None = None
        self._quiet_since = 0.0
        self.table = tunable.rules
        self.measurements = 0
        self.done = False
        self._lock = CacheLock(self.path)
        self._marker = self.path.with_suffix(".untrusted")  # see _untrusted
        self._steps: Generator[None, None, KernelTable] | None = None
        self._attempt = 0
        self._not_before = 0.0
        self._waiting_since: float | None = None
        self._others = self._machine = self._spent = 0.0
        self._loads_known = True

    def step(self) -> float | None:
        """Do the next piece (one timed unit; or look for another process's table): None once the measured (or
        cached) table serves, or the rules for good; else the seconds after which to call again (0: at once)."""
        if self.done:
            return None
        wait = self._not_before - time.monotonic()
        if wait > 0:  # after an untrusted measurement: another process may measure meanwhile
            cached = read_cache(self.path, self.key)
            return self._replace(cached) if cached is not None else min(wait, POLL_S)
        try:
            return self._begin() if self._steps is None else self._unit()
        except Exception:  # a failed measurement must not take the engine thread down: the rules serve on
            log.exception("measuring the kernel table failed; the %s table serves this run", self.table.source)
            self.close()
            apply_table(self.plan, self.table)
            return None

    def close(self) -> None:
        """Stop (the engine stops): the measurement abandoned, the lock let go."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        self._lock.release()
        self.done = True

    def _begin(self) -> float | None:
        cached = read_cache(self.path, self.key)
        if cached is not None:
            return self._replace(cached)
        if self._busy_now():
            return QUIET_S
        if not self._lock.try_take():
            now = time.monotonic()
            if self._waiting_since is None:
                self._waiting_since = now
                log.info("another process is measuring the kernel table; the %s table serves until it is cached",
                         self.table.source, extra={"path": str(self.path)})
            if now - self._waiting_since < self.lock_wait_s:
                return POLL_S
            log.warning("the process measuring the kernel table held its lock over %.0f s; measuring here",
                        self.lock_wait_s, extra={"path": str(self.path)})
        cached = read_cache(self.path, self.key)  # cached between the first look and the lock
        if cached is not None:
            self._lock.release()
            return self._replace(cached)
        count, at = self._untrusted()  # this process's or another's measurements, not trusted, in a row
        if count >= self.attempts:
            self._lock.release()
            log.warning("the last %d measurement(s) of the kernel table on this data dir (by this process or "
                        "another) were not trusted: the %s table serves this run", count, self.table.source,
                        extra={"path": str(self.path)})
            self.close()
            return None
        resume = at + self.retry_s - time.time()
        if count and resume > 0:  # another process's was not trusted a moment ago: the same pause here
            self._lock.release()
            self._not_before = time.monotonic() + resume
            return min(resume, POLL_S)
        self._attempt += 1
        self._others = self._machine = self._spent = 0.0
        self._loads_known = True
        log.info("measuring the kernel table in the background; the %s table serves meanwhile", self.table.source,
                 extra={"model": self.name, "attempt": self._attempt, "of": self.attempts})
        self._steps = measure_steps(self.model, self.plan, self.rules, self.counts, dtype=self.dtype)
        return 0.0

    def _unit(self) -> float | None:
        assert self._steps is not None
        load, t0 = OthersLoad(), time.monotonic()
        try:
            next(self._steps)
            measured = None
        except StopIteration as end:
            measured = end.value
        self._spent += time.monotonic() - t0
        got = load.seconds()
        if got is None:
            self._loads_known = False
        else:
            self._others += got[0]
            self._machine += got[1]
        if measured is None:
            apply_table(self.plan, self.table, keep_packed=True)  # the serving table for the steps between units
            return 0.0
        self._steps = None
        self.measurements += 1
        measured.seconds = self._spent
        share = self._others / self._machine if self._loads_known and self._machine > 0 else None
        if self.busy_share is None or share is None or share <= self.busy_share:
            write_cache(self.path, measured.to_json(self.key))  # before the lock goes: a waiter finds it
            self._marker.unlink(missing_ok=True)
            self._lock.release()
            return self._replace(measured)
        count = self._untrusted()[0] + 1
        write_cache(self._marker, json.dumps({"count": count, "at": time.time()}))  # before the lock goes
        self._lock.release()
        apply_table(self.plan, self.table)  # and the copies the measurement made, dropped
        last = count >= self.attempts or self._attempt >= self.attempts
        log.warning("kernel table measured while other processes used %.0f%% of the CPUs: not trusted; %s",
                    100 * share, f"the {self.table.source} table serves this run (not cached: the next start "
                    "measures again)" if last else f"measuring again in {self.retry_s:.0f} s",
                    extra={"others_share": round(share, 2), "limit": self.busy_share, "attempt": self._attempt})
        if last:
            self.close()
            return None
        self._not_before = time.monotonic() + self.retry_s
        return min(self.retry_s, POLL_S)  # meanwhile, looking for another process's table

    def _busy_now(self) -> bool:
        """Whether other processes held the CPUs since the last look (another generator loading its model: a
        measurement now would slow it and not be trusted), for up to ``quiet_wait_s``; then measuring anyway."""
        if self.busy_share is None or self.quiet_wait_s <= 0:
            return False
        now = time.monotonic()
        if self._quiet is None:
            self._quiet, self._quiet_since = OthersLoad(), now
            return True
        share = self._quiet.share()
        self._quiet = OthersLoad()
        return share is not None and share > self.busy_share and now - self._quiet_since < self.quiet_wait_s

    def _untrusted(self) -> tuple[int, float]:
        """How many measurements in a row were not trusted on this data dir (by any process), and when the last
        ended (``time.time()``); (0, 0) without any, or where the last is older than a chain of them (an earlier
        run's: this one measures again)."""
        try:
            raw = json.loads(self._marker.read_text(encoding="utf-8"))
            count, at = int(raw["count"]), float(raw["at"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0.0
        return (count, at) if time.time() - at <= self.retry_s + _CHAIN_S else (0, 0.0)

    def _replace(self, table: KernelTable) -> float | None:
        apply_table(self.plan, table)
        release_freed_memory()
        previous, self.table = self.table, table
        log.info("kernel table (%s) replaces the %s table: %s", table.source, previous.source, table.summary(),
                 extra={"kernels": table.source, "seconds": round(table.seconds, 2), "model": self.name})
        self.close()
        return None


def tune_in_background(model: Any, plan: Plan, *, name: str, dtype: torch.dtype, dense_rows: int, max_batch: int,
                       data_dir: str, setting: str = "auto", busy_share: float | None = BUSY_SHARE,
                       float_weights: str = "keep") -> tuple[KernelTable, BackgroundTuning | None]:
    """The table that serves ``plan`` from now (applied): the cached one, the ``setting``'s, or, where the table is
    measured and none is cached yet, the rules, with the :class:`BackgroundTuning` that measures the
    table (None where nothing is left to measure)."""
    tunable = prepare_plan(model, plan, dtype=dtype, dense_rows=dense_rows, max_batch=max_batch, name=name,
                           data_dir=data_dir, setting=setting, float_weights=float_weights)
    table = tunable.rules
    if tunable.key is not None and tunable.path is not None:
        table = read_cache(tunable.path, tunable.key) or table
    apply_table(plan, table)
    pending = table.source == "rules" and tunable.key is not None
    log.info("kernel table (%s)%s: %s", table.source, ", until the one measured in the background replaces it"
             if pending else "", table.summary(), extra={"kernels": table.source, "model": name})
    if not pending:
        return table, None
    return table, BackgroundTuning(model, plan, tunable, dtype=dtype, name=name, busy_share=busy_share)
