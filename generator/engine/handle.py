"""The engine as the service layer sees it: jobs in, per-step emissions out, a snapshot of its counters.

:class:`EngineHandle` is what the worker, the announcer and the gauges use of an engine, whether it
runs on a thread of the generator (:class:`~generator.engine.runner.Runner`) or in a process of its
own (:class:`~generator.engine.process.EngineProcess`); both implement it explicitly. Nothing here
imports torch or NATS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenpipe.wire import FinishReason, Request, Usage

__all__ = ["Emission", "EngineHandle", "EngineStats", "Job"]


@dataclass(frozen=True)
class Job:
    """A request to run. ``resume_ids`` are tokens already generated (and published) for it."""

    request: Request
    resume_ids: tuple[int, ...] = ()
    # More of the same burst were fetched with this one and are being handed over right behind it.
    more_coming: bool = False
    # What the engine keys the job by (its emissions' ``request_id``, :meth:`EngineHandle.cancel`'s
    # argument): the worker's ``tokenpipe.subjects.stream_key`` (owner and id: two owners may run
    # the same id at once); the request's id when left empty.
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.request.id)


@dataclass(frozen=True, slots=True)
class Emission:
    """What one engine step produced for one request."""

    request_id: str  # the job's key (Job.key)
    token_ids: tuple[int, ...]
    text: str
    at_ns: int
    finish: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    admitted_ns: int = 0
    error_code: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters at one moment: what the announcements and the KV-cache gauges read."""

    running: int = 0  # sequences in the batch
    preemptions: int = 0  # since the engine started
    block_size: int = 0  # KV positions a block holds
    blocks_used: int = 0  # held by a sequence
    blocks_capacity: int = 0  # every block a sequence could hold (the scratch block not counted)
    blocks_cached: int = 0  # held by none, keeping a prefix for reuse
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # ... and found there

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could get now: free ones and cached ones nobody holds."""
        return self.blocks_capacity - self.blocks_used


class EngineHandle(Protocol):
    """An engine the service layer drives: thread-safe, its emissions delivered to the callback it was made with."""

    def start(self) -> None:
        """Start stepping (and delivering emissions)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping; blocks up to ``timeout`` seconds (call it from a thread, not the event loop)."""

    def submit(self, job: Job) -> None:
        """Hand a job over; its emissions follow."""

    def cancel(self, request_id: str) -> None:
        """End a request early (``request_id``: its job's key): its last emission says ``cancelled``."""

    @property
    def memory_room(self) -> int:
        """More requests the KV cache can take now, less those handed over and not yet queued."""
        ...

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        ...

    def stats(self) -> EngineStats:
        """The engine's counters now."""
        ...
