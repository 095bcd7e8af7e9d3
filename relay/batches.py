"""``/v1/batches`` as OpenAI's: create a batch from an uploaded file, read it, list them, cancel it.
The work itself is :mod:`relay.batchrun`'s; these routes only read and write batch records
(:mod:`relay.batchdb`). Tenant-scoped: another tenant's batch is a 404, as a missing one is."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from tokenpipe.errors import InvalidRequest, NotFound

from .batchdb import BatchRecord, Conflict, new_batch_id
from .batchproto import BATCH_ID_PATTERN, BatchCreate, BatchList, BatchObject
from .http import JSONBodyRoute
from .native import state_of, tenant_of

__all__ = ["router"]

_CANCEL_TRIES = 5  # compare-and-set rounds against the runner's own writes
BatchId = Annotated[str, Path(pattern=BATCH_ID_PATTERN)]

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/batches", response_model=BatchObject)
async def create_batch(body: BatchCreate, request: Request) -> BatchObject:
    """Run every line of ``input_file_id`` at the batch class (``service_tier: flex``)."""
    state = state_of(request)
    tenant = tenant_of(request)
    try:
        file = await state.batchdb.file(tenant, body.input_file_id)
    except NotFound as exc:
        raise NotFound(f"no file {body.input_file_id!r}: upload it with POST /v1/files first",
                       param="input_file_id") from exc
    if file.purpose != "batch":
        raise InvalidRequest(f"file {file.id!r} has purpose {file.purpose!r}; a batch's input needs 'batch'",
                             param="input_file_id")
    now = int(time.time())
    batch = BatchObject(id=new_batch_id(), endpoint=body.endpoint, input_file_id=file.id,
                        completion_window=body.completion_window, status="validating", created_at=now,
                        expires_at=now + int(state.settings.batch_window_s), metadata=body.metadata)
    await state.batchdb.create_batch(BatchRecord(batch, tenant))
    request.app.state.batchrunner.wake()
    return batch


@router.get("/v1/batches/{batch_id}", response_model=BatchObject)
async def retrieve_batch(batch_id: BatchId, request: Request) -> BatchObject:
    return (await state_of(request).batchdb.batch(tenant_of(request), batch_id)).batch


@router.get("/v1/batches", response_model=BatchList)
async def list_batches(request: Request, after: Annotated[str | None, Query(max_length=64)] = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    """This tenant's batches, newest first; ``after`` (a batch id) pages on."""
    records = await state_of(request).batchdb.batches(tenant_of(request))
    batches = sorted((r.batch for r in records), key=lambda b: (-b.created_at, b.id))
    if after is not None:
        ids = [b.id for b in batches]
        batches = batches[ids.index(after) + 1:] if after in ids else []
    page = batches[:limit]
    return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=len(batches) > limit)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: BatchId, request: Request) -> BatchObject:
    """Stop a batch: its runner cancels the lines in flight, runs no more, and writes the output and
    error files of the lines done (``cancelling``, then ``cancelled``). A finished batch is returned as it is."""
    state = state_of(request)
    tenant = tenant_of(request)
    for _ in range(_CANCEL_TRIES):
        record = await state.batchdb.batch(tenant, batch_id)
        if record.batch.status not in ("validating", "in_progress"):
            return record.batch
        record.batch.status = "cancelling"
        record.batch.cancelling_at = int(time.time())
        try:
            await state.batchdb.update(record)
        except Conflict:
            continue  # the runner wrote its progress meanwhile: read it again
        request.app.state.batchrunner.wake()
        return record.batch
    raise Conflict(f"batch {batch_id} kept changing; try again")
