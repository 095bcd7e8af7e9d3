"""Who is admitted next: the engine's waiting sequences in two classes, and each owner's fair share.

Interactive sequences wait ahead of every batch one (``flex``, the Batch API); a preempted sequence
goes back first of its class. Within a class the next sequence admitted is the first waiting one of
the owner with the fewest running rows of that class per unit of weight (weighted fair queuing over
seats, as Kubernetes' API Priority and Fairness), ties to the one waiting longest; an owner already
running ``owner_max_running`` sequences is passed over. These are the choices alone: the engine
(generator.engine.scheduler) holds the rows and the KV blocks, and preempts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Generic, Protocol, TypeVar

__all__ = ["Lanes", "Seat", "running"]


class Seat(Protocol):
    """What the choices read of a sequence (generator.engine.scheduler.Sequence)."""

    batch: bool  # batch work (flex, the Batch API), not interactive
    owner: str
    weight: float  # the owner's fair-share weight


Sequence = TypeVar("Sequence", bound=Seat)


def running(rows: Iterable[Seat]) -> dict[str, int]:
    """Rows per owner."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.owner] = counts.get(r.owner, 0) + 1
    return counts


class Lanes(Generic[Sequence]):
    """The waiting sequences, partitioned: every interactive one ahead of every batch one."""

    def __init__(self, owner_max_running: int = 0) -> None:
        self.owner_max_running = owner_max_running  # per owner, both classes (0: fair share alone)
        self.waiting: deque[Sequence] = deque()

    def enqueue(self, seq: Sequence, *, front: bool = False) -> None:
        """Queue ``seq`` behind the waiting sequences of its class (``front``: ahead of them, a preempted one)."""
        interactive = sum(1 for s in self.waiting if not s.batch)
        if seq.batch:
            self.waiting.insert(interactive if front else len(self.waiting), seq)
        else:
            self.waiting.insert(0 if front else interactive, seq)

    def capped(self, seq: Seat, rows: Iterable[Seat], admitted: Mapping[str, int]) -> bool:
        """``seq``'s owner runs ``owner_max_running`` sequences already (of ``rows``, and ``admitted`` this
        step, per owner)."""
        if self.owner_max_running <= 0:
            return False
        mine = sum(1 for r in rows if r.owner == seq.owner) + admitted.get(seq.owner, 0)
        return mine >= self.owner_max_running

    def next(self, rows: list[Sequence], admitted: Mapping[str, int]) -> Sequence | None:
        """The waiting sequence to admit next beside the running ``rows`` (``admitted``: those admitted this
        step, per owner, counted too); None: nobody can be admitted."""
        best: Sequence | None = None
        best_share = 0.0
        seen: set[tuple[bool, str]] = set()
        batch = False
        counts = running(r for r in rows if not r.batch)
        for seq in self.waiting:  # partitioned: interactive ones first
            if seq.batch != batch:
                if best is not None:
                    break  # an interactive one goes first
                batch, counts = True, running(r for r in rows if r.batch)
            if (seq.batch, seq.owner) in seen:
                continue  # each owner's own waiting sequences run first come first served
            seen.add((seq.batch, seq.owner))
            if self.capped(seq, rows, admitted):
                continue
            share = (counts.get(seq.owner, 0) + admitted.get(seq.owner, 0)) / seq.weight
            if best is None or share < best_share:
                best, best_share = seq, share
        return best
