"""The Batch API's HTTP bodies, as OpenAI's (``/v1/files``, ``/v1/batches``): the official SDK
reads them unmodified. Kept apart from :mod:`relay.protocol` (the streaming routes' bodies)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

__all__ = ["BATCH_ENDPOINTS", "BatchCreate", "BatchError", "BatchErrors", "BatchList", "BatchObject", "BatchStatus",
           "FileDeleted", "FileList", "FileObject", "RequestCounts", "OPEN_STATUSES", "FILE_ID_PATTERN",
           "BATCH_ID_PATTERN"]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
OPEN_STATUSES = frozenset({"validating", "in_progress", "finalizing", "cancelling"})  # a runner still owes them work
FILE_ID_PATTERN = r"^file-[0-9a-f]{24}$"
BATCH_ID_PATTERN = r"^batch_[0-9a-f]{24}$"
MetadataValue = Annotated[str, StringConstraints(strict=True, max_length=512)]
MetadataKey = Annotated[str, StringConstraints(strict=True, max_length=64)]


class FileObject(BaseModel):
    """OpenAI's file object. ``purpose``: ``batch`` (an upload) or ``batch_output`` (a batch's
    output or error file)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreate(BaseModel):
    """``POST /v1/batches``; unknown fields are ignored, as OpenAI's SDK may send new ones."""

    model_config = ConfigDict(extra="ignore")
    input_file_id: Annotated[str, StringConstraints(strict=True, max_length=64)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"] = Field(
        description="every line's `url` must be this endpoint")
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, Any] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
