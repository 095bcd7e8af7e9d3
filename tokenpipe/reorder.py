"""One stream's batches back in ``seq`` order: the reorder and gap buffer every reader shares.

The contract: fed whatever a transport delivers for one stream — in any order, with
duplicates, with holes — a :class:`Reorder` hands out the batches with ``seq > after``, in
``seq`` order, each once, or an explicit :class:`Gap` where some will never come, and ends
after the final batch. A reader resuming after the final batch is still told the end: the
final batch again, without its tokens (they were seen).

A missing batch becomes a :class:`Gap` in one of two ways, named by its ``reason``:

- :data:`EXPIRED`: the reader has read everything stored (:meth:`Reorder.caught_up`) and the
  oldest stored batch is newer than the one wanted — retention removed the rest;
- :data:`LOST`: later batches have been held back for ``wait`` seconds (:attr:`Reorder.deadline`)
  and the missing one still did not come (:meth:`Reorder.expire`). A batch republished after
  a NATS outage can be stored after later ones, so a hole is first waited for; one that was
  never stored never comes.

Pure: no I/O and no clock of its own (callers pass ``now``, any monotonic seconds), so the
same object serves ``streams.follow`` (one JetStream consumer) and the relay's fan-out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from .telemetry import trace_context_headers
from .wire import TokenBatch

__all__ = ["EXPIRED", "LOST", "Gap", "Reorder"]

EXPIRED = "expired from history (retention)"
LOST = "lost: never stored after a NATS outage"


@dataclass(frozen=True)
class Gap:
    """Batches ``from_seq..to_seq`` will not arrive: expired from history, or lost for good."""

    from_seq: int
    to_seq: int
    reason: str


class Reorder:
    """Reorder buffer for the batches of one stream with ``seq > after``.

    Feed batches with :meth:`feed`, report a complete read of the stored history with
    :meth:`caught_up`, call :meth:`expire` once :attr:`deadline` has passed, and take what is
    ready with :meth:`ready` after each of them. :attr:`done` turns true once the final batch
    has been handed out; everything fed after that is ignored.

    The hole clock starts when the buffer starts holding batches back, keeps running while it
    holds any (a hole filled while another remains does not restart it), and restarts after
    each :data:`LOST` gap.
    """

    __slots__ = ("_held", "_ready", "_since", "after", "done", "expected", "trace_headers", "wait")

    def __init__(self, after: int = -1, *, wait: float = 15.0,
                 trace_headers: dict[str, str] | None = None) -> None:
        self.after = after
        self.wait = wait
        self.expected = after + 1  # the next seq to hand out
        self.done = False
        # Filled from the first batch fed whose headers carry W3C trace context (the generation's).
        self.trace_headers: dict[str, str] = {} if trace_headers is None else trace_headers
        self._held: dict[int, TokenBatch] = {}
        self._ready: deque[TokenBatch | Gap] = deque()
        self._since: float | None = None

    @property
    def holding(self) -> bool:
        """Whether batches are held back behind a missing one."""
        return bool(self._held)

    @property
    def hole_since(self) -> float | None:
        """When the hole clock started (None while nothing is held back)."""
        return self._since

    @property
    def deadline(self) -> float | None:
        """When the first missing batch is declared :data:`LOST` (None while nothing is held back)."""
        return None if self._since is None else self._since + self.wait

    def feed(self, batch: TokenBatch, headers: Mapping[str, str] | None = None, *, now: float) -> None:
        """One batch as delivered (``headers``: the message headers it came with, if any)."""
        if self.done:
            return
        if headers and not self.trace_headers:
            self.trace_headers.update(trace_context_headers(headers))
        if batch.seq < self.expected:
            if batch.is_final and batch.seq <= self.after and self.expected == self.after + 1:
                # Resuming after the final batch: its tokens were seen, but the end must still be told.
                self._ready.append(msgspec.structs.replace(batch, token_ids=(), text=""))
                self._finish()
            return  # already handed out (a republished duplicate) or before the resume point
        self._held.setdefault(batch.seq, batch)
        self._release(now)

    def caught_up(self, oldest_stored: int, *, now: float) -> None:
        """Everything stored so far has been fed, and the oldest stored batch has ``seq``
        ``oldest_stored``: whatever is missing below it was removed by retention."""
        if self.done or self.expected in self._held or oldest_stored <= self.expected:
            return
        self._gap(min(oldest_stored, *self._held) if self._held else oldest_stored, EXPIRED, now)

    def expire(self, now: float) -> bool:
        """Declare the first missing batches :data:`LOST` if :attr:`deadline` has passed;
        returns whether it had (a gap is then ready)."""
        deadline = self.deadline
        if deadline is None or now < deadline:
            return False
        self._since = None  # the next hole gets a wait of its own
        self._gap(min(self._held), LOST, now)
        return True

    def ready(self) -> list[TokenBatch | Gap]:
        """Batches and gaps ready to hand out, in order (each returned once)."""
        out = list(self._ready)
        self._ready.clear()
        return out

    def _gap(self, upto: int, reason: str, now: float) -> None:
        self._ready.append(Gap(self.expected, upto - 1, reason))
        self.expected = upto
        self._release(now)

    def _release(self, now: float) -> None:
        while self.expected in self._held:
            batch = self._held.pop(self.expected)
            self.expected += 1
            self._ready.append(batch)
            if batch.is_final:
                self._finish()
                return
        if not self._held:
            self._since = None
        elif self._since is None:
            self._since = now

    def _finish(self) -> None:
        self.done = True
        self._held.clear()
        self._since = None
