"""``/v1/files`` as OpenAI's, for the Batch API: upload a JSONL file of requests (purpose
``batch``), read a file's record and content (a batch's output and error files too), list and
delete. Tenant-scoped: another tenant's file is a 404, as a missing one is.

An upload is checked whole before it is stored: its size (413 past ``batch_file_max_bytes``), its
purpose (only ``batch``), and that it is JSONL (UTF-8, one JSON object per non-blank line, at
least one). What each line asks for is checked when the batch runs: a bad line goes to the
batch's error file and never stops the others.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from tokenpipe.errors import InvalidRequest

from .batchproto import FILE_ID_PATTERN, FileDeleted, FileList, FileObject
from .http import ClientGone, RequestTooLarge
from .native import state_of, tenant_of

__all__ = ["router", "check_jsonl", "MAX_LINES"]

MAX_LINES = 50_000  # requests in one batch file, as OpenAI's bound
_FORM_SLACK = 64 << 10  # multipart framing and the other fields, on top of the file itself
FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN)]

_UPLOAD_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL: one request per line"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}


class FileTooLarge(RequestTooLarge):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.message = f"the file exceeds {limit} bytes (TOKENPIPE_BATCH_FILE_MAX_BYTES)"


def check_jsonl(data: bytes) -> list[dict[str, Any]]:
    """``data`` as JSONL: one JSON object per non-blank line; :class:`InvalidRequest` (400) naming
    the first line that is not one, or a file with none."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the file is not UTF-8 text (byte {exc.start})", param="file") from exc
    lines: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(f"the file is not JSONL: line {number} is not JSON ({exc})", param="file") from exc
        if not isinstance(obj, dict):
            raise InvalidRequest(f"the file is not JSONL: line {number} is not a JSON object", param="file")
        lines.append(obj)
        if len(lines) > MAX_LINES:
            raise InvalidRequest(f"the file has more than {MAX_LINES} requests", param="file")
    if not lines:
        raise InvalidRequest("the file holds no requests (expected JSONL: one JSON object per line)", param="file")
    return lines


async def _read_form_body(request: Request, limit: int) -> None:
    """Read the body, refusing (413) one past the file bound plus the form's framing before it is all read."""
    bound = limit + _FORM_SLACK
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > bound:
        raise FileTooLarge(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > bound:
                raise FileTooLarge(limit)
    except ClientDisconnect as exc:
        raise ClientGone("the client closed the connection mid-body") from exc
    request._body = bytes(body)  # request.form() parses it from here


router = APIRouter()


@router.post("/v1/files", response_model=FileObject, openapi_extra=_UPLOAD_SCHEMA)
async def upload_file(request: Request) -> FileObject:
    """Upload a batch input file (multipart: ``file`` and ``purpose=batch``)."""
    state = state_of(request)
    limit = state.settings.batch_file_max_bytes
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise InvalidRequest("upload the file as multipart/form-data with fields 'file' and 'purpose'",
                             param="content-type")
    await _read_form_body(request, limit)
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # python-multipart's parse errors, Starlette's bounds
        raise InvalidRequest(f"malformed multipart body: {exc}") from exc
    try:
        purpose = form.get("purpose")
        if not isinstance(purpose, str):
            raise InvalidRequest("'purpose' is required", param="purpose")
        if purpose != "batch":
            raise InvalidRequest(f"unsupported purpose {purpose[:64]!r}: this server accepts 'batch'", param="purpose")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("'file' is required (a file part)", param="file")
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise FileTooLarge(limit)
        check_jsonl(data)
        filename = (upload.filename or "upload.jsonl")[:256]
    finally:
        await form.close()
    return await state.batchdb.put_file(tenant_of(request), filename, purpose, data, state.settings.batch_retention_s)


@router.get("/v1/files", response_model=FileList)
async def list_files(request: Request) -> FileList:
    """This tenant's files, newest first."""
    files = sorted(await state_of(request).batchdb.files(tenant_of(request)), key=lambda f: (-f.created_at, f.id))
    return FileList(data=files, first_id=files[0].id if files else None, last_id=files[-1].id if files else None)


@router.get("/v1/files/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: FileId, request: Request) -> FileObject:
    return await state_of(request).batchdb.file(tenant_of(request), file_id)


@router.get("/v1/files/{file_id}/content", response_class=Response,
            responses={200: {"description": "the file's bytes", "content": {"application/octet-stream": {}}}})
async def file_content(file_id: FileId, request: Request) -> Response:
    data = await state_of(request).batchdb.content(tenant_of(request), file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: FileId, request: Request) -> FileDeleted:
    """Forget the file: it is a 404 from now on (its bytes leave the store with retention)."""
    await state_of(request).batchdb.delete_file(tenant_of(request), file_id)
    return FileDeleted(id=file_id, deleted=True)
