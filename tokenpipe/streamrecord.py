"""One stream as one JSON document: its request, every batch with its timings, and what they add
up to. The one definition of the format that the relay's ``GET /v1/streams/{id}/export``, the
inspector page (export and import) and ``tokenpipe replay --json`` share.

Times are the batches' own wall-clock stamps (ns, :class:`~tokenpipe.wire.TokenBatch`). Tokens
carry no stamps of their own, so inter-token latency is estimated from the batches: the tokens
of a batch are spread evenly between its ``first_token`` and the next batch's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from .bus import Bus
from .streamindex import read_request
from .streams import stored
from .wire import StreamMeta, TokenBatch

__all__ = ["FORMAT", "SERVED_BY_HEADER", "BatchRecord", "GapRecord", "StreamRecord", "StreamSummary", "brief",
           "build", "read", "summarize", "trace_id"]

FORMAT: Literal["tokenpipe.stream/1"] = "tokenpipe.stream/1"
# On the first batch a generator stores for a delivery: its worker id (the inspector's "served by").
SERVED_BY_HEADER = "Tp-Served-By"


class BatchRecord(BaseModel):
    """A token batch as recorded (the fields of :class:`~tokenpipe.wire.TokenBatch`)."""

    seq: int
    index: int
    token_ids: list[int]
    text: str
    finish: str | None = None
    error: str | None = None
    error_code: str | None = None
    usage: dict[str, int] | None = None
    timings: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, batch: TokenBatch) -> BatchRecord:
        return cls(seq=batch.seq, index=batch.index, token_ids=list(batch.token_ids), text=batch.text,
                   finish=batch.finish, error=batch.error, error_code=batch.error_code,
                   usage=batch.usage.to_map() if batch.usage else None, timings=dict(batch.timings))


class GapRecord(BaseModel):
    """Batches ``from_seq..to_seq`` (inclusive) are not stored (past retention, or lost)."""

    from_seq: int
    to_seq: int


class StreamSummary(BaseModel):
    """Where a stream's time went, in milliseconds (None: not known from the stored batches)."""

    tokens: int = 0
    batches: int = 0
    finish: str | None = None
    queue_ms: float | None = Field(default=None, description="created → pulled by a generator")
    admission_ms: float | None = Field(default=None, description="pulled → given a batch slot")
    prefill_ms: float | None = Field(default=None, description="admitted → first token")
    ttft_ms: float | None = Field(default=None, description="created → first batch published")
    duration_ms: float | None = Field(default=None, description="created → last batch published")
    tokens_per_s: float | None = Field(default=None, description="tokens after the first batch / time after it")
    itl_p50_ms: float | None = Field(default=None, description="inter-token latency, median (estimated from batches)")
    itl_p99_ms: float | None = Field(default=None, description="inter-token latency, 99th percentile (estimated)")
    served_by: list[str] = Field(default_factory=list, description="the generators that served it (worker ids, "
                                 "from each delivery's first batch), in order: more than one after a takeover")


class StreamRecord(BaseModel):
    """The exported stream (``format`` names this shape and its version)."""

    format: Literal["tokenpipe.stream/1"] = FORMAT
    id: str
    model: str
    created_at: int = Field(description="request created, wall clock ns")
    request: dict[str, Any] | None = Field(
        None, description="the request as submitted (prompt or messages, params, coalesce); null if not kept")
    traceparent: str | None = None
    trace_id: str | None = None
    batches: list[BatchRecord]
    gaps: list[GapRecord] = Field(default_factory=list)
    summary: StreamSummary


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
    parts = (traceparent or "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1]
    return None


def _ms(later: int | None, earlier: int | None) -> float | None:
    if later is None or earlier is None or later < earlier:
        return None
    return round((later - earlier) / 1e6, 3)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 3)


def brief(created_at: int, first: TokenBatch | None, last: TokenBatch | None) -> StreamSummary:
    """What a stream's first and last stored batches tell (a listing reads only those two)."""
    if last is None:
        return StreamSummary()
    created = (first.timings.get("created") if first is not None else None) or created_at
    return StreamSummary(
        tokens=last.index + len(last.token_ids), batches=last.seq + 1, finish=last.finish,
        ttft_ms=_ms(first.timings.get("emitted"), created) if first is not None and first.seq == 0 else None,
        duration_ms=_ms(last.timings.get("emitted"), created))


def summarize(created_at: int, batches: Sequence[TokenBatch]) -> StreamSummary:
    """Every figure the batches' timings give (``batches`` in ``seq`` order, maybe with holes)."""
    if not batches:
        return StreamSummary()
    first, last = batches[0], batches[-1]
    t0: Mapping[str, int] = first.timings if first.seq == 0 else {}
    created = t0.get("created") or created_at
    out = brief(created_at, first, last)
    out.queue_ms = _ms(t0.get("received"), created)
    out.admission_ms = _ms(t0.get("admitted"), t0.get("received"))
    out.prefill_ms = _ms(t0.get("first_token"), t0.get("admitted"))
    later = sum(len(b.token_ids) for b in batches[1:])
    span = _ms(last.timings.get("emitted"), first.timings.get("emitted"))
    out.tokens_per_s = round(later / (span / 1000), 2) if later and span else None
    gaps: list[float] = []
    for prev, nxt in itertools.pairwise(batches):
        step = _ms(nxt.timings.get("first_token"), prev.timings.get("first_token"))
        if step is not None and prev.token_ids and nxt.seq == prev.seq + 1 and nxt.token_ids:
            gaps.extend([step / len(prev.token_ids)] * len(prev.token_ids))
    out.itl_p50_ms, out.itl_p99_ms = _percentile(gaps, 0.5), _percentile(gaps, 0.99)
    return out


def build(meta: StreamMeta, batches: Mapping[int, TokenBatch], *, request: Mapping[str, Any] | None = None,
          traceparent: str | None = None, served_by: Sequence[str] = ()) -> StreamRecord:
    """The record of a stream from its stored batches by ``seq`` (up to the final one)."""
    ordered = [batches[s] for s in sorted(batches)]
    final = next((i for i, b in enumerate(ordered) if b.is_final), None)
    if final is not None:
        ordered = ordered[:final + 1]
    gaps: list[GapRecord] = []
    expected = 0
    for batch in ordered:
        if batch.seq > expected:
            gaps.append(GapRecord(from_seq=expected, to_seq=batch.seq - 1))
        expected = batch.seq + 1
    shown = {k: v for k, v in request.items() if k not in ("tenant", "v")} if request is not None else None
    summary = summarize(meta.created_at, ordered)
    summary.served_by = list(served_by)
    return StreamRecord(id=meta.id, model=meta.model, created_at=meta.created_at, request=shown,
                        traceparent=traceparent or None, trace_id=trace_id(traceparent),
                        batches=[BatchRecord.of(b) for b in ordered], gaps=gaps, summary=summary)


async def read(bus: Bus, meta: StreamMeta) -> StreamRecord:
    """The record of a relay stream as JetStream holds it now (a running stream: so far)."""
    kept = await stored(bus, meta.id)
    indexed = await read_request(bus, meta)
    first_headers = kept[min(kept)][1] if kept else {}
    traceparent = first_headers.get("traceparent") or (indexed.traceparent if indexed is not None else None)
    served = [h[SERVED_BY_HEADER] for _, (_, h) in sorted(kept.items()) if h.get(SERVED_BY_HEADER)]
    return build(meta, {seq: batch for seq, (batch, _) in kept.items()},
                 request=indexed.request.to_map() if indexed is not None else None, traceparent=traceparent,
                 served_by=list(dict.fromkeys(served)))
