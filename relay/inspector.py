"""The stream inspector: ``GET /v1/streams`` (the caller's tenant's recent streams),
``GET /v1/streams/{id}/export`` (one stream as a :mod:`tokenpipe.streamrecord` document) and the
``/inspect`` page that shows them.

A listing reads the names of the tenant's index keys (:mod:`tokenpipe.streamindex`: nobody else's),
then, for the page only, each stream's last batch (one direct get) and, once, its first (TTFT);
a finished stream's summary never changes and is kept here. A ``finish`` filter examines at most
:data:`SCAN_LIMIT` streams per call and says where it stopped (``next_before``).
"""

from __future__ import annotations

import asyncio
import html
import time
from collections import OrderedDict
from importlib import resources
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field

from tokenpipe import streamrecord
from tokenpipe.bus import Bus
from tokenpipe.streamindex import IndexEntry, list_entries
from tokenpipe.streamrecord import StreamRecord, StreamSummary
from tokenpipe.streams import first_stored, last_batch, stream_not_found
from tokenpipe.wire import TokenBatch

from .batchproto import BATCH_ID_PATTERN
from .native import state_of, tenant_of
from .protocol import ID_PATTERN

__all__ = ["Inspector", "StreamList", "StreamListItem", "page_router", "router", "SCAN_LIMIT"]

router = APIRouter()  # under /v1: authenticated
page_router = APIRouter()  # the page itself (it asks for a key when keys are on)

SCAN_LIMIT = 200  # streams a filtered listing examines per call, at most
_KEPT = 10_000  # finished streams' summaries (and running ones' first batches) kept per relay
_READS = 8  # concurrent history reads per listing

T = TypeVar("T")
Status = Literal["queued", "running", "finished", "expired"]
Finish = Literal["stop", "length", "cancelled", "error"]


class StreamListItem(StreamSummary):
    """One stream in a listing (the summary's figures that its first and last batches give)."""

    id: str
    model: str
    created: int = Field(description="request created, Unix seconds")
    created_ns: int = Field(description="request created, wall clock ns")
    status: Status


class StreamList(BaseModel):
    object: Literal["list"] = "list"
    data: list[StreamListItem]
    has_more: bool = Field(description="older streams follow: pass `next_before` as `before`")
    next_before: str | None = None


class Inspector:
    """What one relay remembers between listings: finished streams' summaries (they never change)
    and running streams' first batches."""

    def __init__(self, retention_s: float) -> None:
        self.retention_s = retention_s
        self.finished: OrderedDict[str, StreamSummary] = OrderedDict()
        self.firsts: OrderedDict[str, TokenBatch] = OrderedDict()
        self._reads = asyncio.Semaphore(_READS)

    async def item(self, bus: Bus, entry: IndexEntry, now_ns: int) -> StreamListItem:
        summary = self.finished.get(entry.id)
        if summary is None:
            async with self._reads:
                summary = await self._summary(bus, entry)
        if summary.finish is not None:
            status: Status = "finished"
        elif summary.batches:
            status = "running"
        else:
            status = "expired" if (now_ns - entry.created_at) / 1e9 > self.retention_s else "queued"
        return StreamListItem(id=entry.id, model=entry.model, created=entry.created_at // 1_000_000_000,
                              created_ns=entry.created_at, status=status, **summary.model_dump())

    async def _summary(self, bus: Bus, entry: IndexEntry) -> StreamSummary:
        last = await last_batch(bus, entry.id)
        first = self.firsts.get(entry.id)
        if last is not None and first is None:
            first = last if last.seq == 0 else await first_stored(bus, entry.id)
            if first is not None:
                _keep(self.firsts, entry.id, first)
        summary = streamrecord.brief(entry.created_at, first, last)
        if summary.finish is not None:
            _keep(self.finished, entry.id, summary)
            self.firsts.pop(entry.id, None)
        return summary


def _keep(cache: OrderedDict[str, T], key: str, value: T) -> None:
    cache[key] = value
    while len(cache) > _KEPT:
        cache.popitem(last=False)


@router.get("/v1/streams", response_model=StreamList)
async def list_streams(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        before: Annotated[str | None, Query(pattern=ID_PATTERN, description="a stream id: older ones")] = None,
        model: Annotated[str | None, Query(pattern=ID_PATTERN, description="only this model's streams")] = None,
        finish: Annotated[Finish | None, Query(description="only the streams that ended so")] = None,
        batch: Annotated[str | None, Query(pattern=BATCH_ID_PATTERN,
                                           description="only this batch's lines (streams `<batch id>-<line>`)")] = None,
) -> StreamList:
    """The caller's tenant's streams within the token retention, newest first."""
    state = state_of(request)
    bus = state.require_bus()
    now = time.time_ns()
    horizon = now - int(state.settings.token_max_age_s * 1e9)
    entries = [e for e in await list_entries(bus, tenant_of(request)) if e.created_at >= horizon]
    if before is not None:
        at = next((i for i, e in enumerate(entries) if e.id == before), None)
        if at is None:
            raise stream_not_found(before)  # unknown, expired, or someone else's: the same answer
        entries = entries[at + 1:]
    if model is not None:
        entries = [e for e in entries if e.model == model]
    if batch is not None:  # the ids are in the index keys' names: no value is read to filter
        entries = [e for e in entries if e.id.startswith(batch + "-")]
    candidates = entries[:max(limit, SCAN_LIMIT) if finish is not None else limit]
    inspector: Inspector = request.app.state.inspector
    found: list[StreamListItem] = []
    examined = 0
    step = max(limit, 20)  # read concurrently, a chunk at a time (a filter may skip most)
    while examined < len(candidates) and len(found) < limit:
        chunk = candidates[examined:examined + step]
        for item in await asyncio.gather(*(inspector.item(bus, e, now) for e in chunk)):
            examined += 1
            if finish is None or item.finish == finish:
                found.append(item)
                if len(found) == limit:
                    break
    has_more = examined < len(entries)
    return StreamList(data=found, has_more=has_more,
                      next_before=candidates[examined - 1].id if has_more and examined else None)


@router.get("/v1/streams/{stream_id}/export", response_model=StreamRecord)
async def export_stream(stream_id: Annotated[str, Path(pattern=ID_PATTERN)], request: Request,
                        response: Response) -> StreamRecord:
    """The stream as one JSON document: request, batches with their timings, summary
    (``format: tokenpipe.stream/1``; ``tokenpipe replay --json`` writes the same)."""
    state = state_of(request)
    meta = await state.forwarder.owned_meta(stream_id, tenant_of(request))
    await state.forwarder.check_retained(meta)
    record = await streamrecord.read(state.require_bus(), meta)
    response.headers["Content-Disposition"] = f'attachment; filename="tokenpipe-stream-{stream_id}.json"'
    return record


@page_router.get("/inspect", response_class=HTMLResponse, include_in_schema=False)
async def inspect_page(request: Request) -> HTMLResponse:
    """The inspector page; ``TOKENPIPE_TRACE_URL`` goes in as a meta tag."""
    page = resources.files("relay").joinpath("static/inspect.html").read_text(encoding="utf-8")
    trace_url = html.escape(state_of(request).settings.trace_url, quote=True)
    return HTMLResponse(page.replace("__TRACE_URL__", trace_url, 1))
