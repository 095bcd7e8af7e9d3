"""The Batch API's records on the bus, tenant-scoped: file bytes in the ``tp_files`` object store,
file records and batch states in the ``tp_batches`` KV bucket (:mod:`tokenpipe.batchstore`).

Keys name the tenant (``file.<tenant hex>.<id>``, ``batch.<tenant hex>.<id>``): a tenant's lookup
of another tenant's id finds nothing, the same 404 as an id that never existed. A batch's
record changes by compare-and-set on its revision, so a relay that lost a batch's lease (another
relay took it over) or a cancel racing a progress write never overwrites the other's change.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from tokenpipe.bus import Bus
from tokenpipe.errors import NotFound, TokenpipeError, TransportError
from tokenpipe.retry import through_elections
from tokenpipe.subjects import BATCHES_BUCKET, BATCHES_STREAM, FILES_BUCKET, FILES_STREAM

from .batchproto import BATCH_ID_PATTERN, FILE_ID_PATTERN, BatchObject, FileObject

__all__ = ["BatchDB", "BatchRecord", "Conflict", "new_batch_id", "new_file_id"]

_READ_TIMEOUT_S = 30.0  # one file's chunks, read back
_SCAN_CONCURRENCY = 64  # direct gets in flight while listing records
_FILE_ID = re.compile(FILE_ID_PATTERN)
_BATCH_ID = re.compile(BATCH_ID_PATTERN)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _tenant(tenant: str) -> str:
    """A tenant as a KV key token: hex, so any tenant name is one valid token and none collides."""
    return tenant.encode().hex() or "00"


class Conflict(TokenpipeError):
    """A batch record changed since it was read (compare-and-set failed): read it again."""

    code = "conflict"
    status = 409


@dataclass
class BatchRecord:
    """A batch as stored: the public object, whose it is, and which runner holds it until when."""

    batch: BatchObject
    tenant: str
    runner: str = ""
    lease_until: float = 0.0
    revision: int = 0  # the KV revision it was read at (0: not stored yet)

    @property
    def key(self) -> str:
        return f"batch.{_tenant(self.tenant)}.{self.batch.id}"

    def encode(self) -> bytes:
        return json.dumps({"batch": self.batch.model_dump(), "tenant": self.tenant, "runner": self.runner,
                           "lease_until": self.lease_until}).encode()

    @classmethod
    def decode(cls, data: bytes, revision: int) -> BatchRecord:
        raw = json.loads(data)
        return cls(BatchObject.model_validate(raw["batch"]), str(raw["tenant"]), str(raw.get("runner", "")),
                   float(raw.get("lease_until", 0.0)), revision)


class BatchDB:
    """Opened lazily: the buckets are the admin's to create, and may appear after the relay starts."""

    def __init__(self, bus: Callable[[], Bus]) -> None:
        self._bus = bus
        self._kv: KeyValue | None = None
        self._obj: ObjectStore | None = None

    async def _open(self) -> tuple[KeyValue, ObjectStore]:
        if self._kv is None or self._obj is None:
            js = self._bus().js
            try:
                self._kv = await js.key_value(BATCHES_BUCKET)
                self._obj = await js.object_store(FILES_BUCKET)
            except Exception as exc:  # not provisioned yet, or JetStream unreachable
                raise TransportError(f"the Batch API's storage is unavailable: {exc!r}") from exc
        return self._kv, self._obj

    # -- files ------------------------------------------------------------------------------------

    async def put_file(self, tenant: str, filename: str, purpose: str, data: bytes, retention_s: float) -> FileObject:
        """Store ``data`` as a new file of ``tenant``: bytes first, then the record that makes it visible."""
        kv, obj = await self._open()
        now = int(time.time())
        file = FileObject(id=new_file_id(), bytes=len(data), created_at=now, filename=filename,
                          purpose=purpose, expires_at=now + int(retention_s))  # type: ignore[arg-type]
        try:
            await obj.put(file.id, data)
            await kv.put(f"file.{_tenant(tenant)}.{file.id}", file.model_dump_json().encode())
        except Exception as exc:  # nats errors and timeouts: one translation point
            raise TransportError(f"could not store file: {exc!r}") from exc
        return file

    async def file(self, tenant: str, file_id: str) -> FileObject:
        if not _FILE_ID.fullmatch(file_id):  # no such key can exist (nor be asked of the bucket)
            raise NotFound(f"no file {file_id[:80]!r}", param="file_id")
        kv, _ = await self._open()
        entry = await self._get(kv, f"file.{_tenant(tenant)}.{file_id}")
        if entry is None:
            raise NotFound(f"no file {file_id!r}", param="file_id")
        return FileObject.model_validate_json(entry[0])

    async def files(self, tenant: str) -> list[FileObject]:
        kv, _ = await self._open()
        return [FileObject.model_validate_json(v) for v, _ in await self._scan(kv, f"file.{_tenant(tenant)}.*")]

    async def delete_file(self, tenant: str, file_id: str) -> None:
        """Forget the record (the bytes go with retention: removing them is the admin's purge)."""
        await self.file(tenant, file_id)
        kv, _ = await self._open()
        try:
            await kv.delete(f"file.{_tenant(tenant)}.{file_id}")
        except Exception as exc:
            raise TransportError(f"could not delete file: {exc!r}") from exc

    async def content(self, tenant: str, file_id: str) -> bytes:
        """A file's bytes, read back through an ordered consumer on its chunks (checked against its digest)."""
        await self.file(tenant, file_id)
        _, obj = await self._open()
        js = self._bus().js
        try:
            info = await obj.get_info(file_id)
            if not info.size:
                return b""
            sub = await js.subscribe(f"$O.{FILES_BUCKET}.C.{info.nuid}", stream=FILES_STREAM, ordered_consumer=True)
            data = bytearray()
            try:
                async with asyncio.timeout(_READ_TIMEOUT_S):
                    async for msg in sub.messages:
                        data += msg.data
                        if msg.metadata.num_pending == 0:
                            break
            finally:
                await sub.unsubscribe()
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError) as exc:
            raise NotFound(f"the content of file {file_id!r} is gone (past retention)", param="file_id") from exc
        except Exception as exc:
            raise TransportError(f"could not read file {file_id!r}: {exc!r}") from exc
        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        if info.digest and info.digest.upper() != digest.upper():
            raise TransportError(f"file {file_id!r} is damaged: its digest does not match")
        return bytes(data)

    # -- batches ----------------------------------------------------------------------------------

    async def create_batch(self, record: BatchRecord) -> BatchRecord:
        kv, _ = await self._open()
        try:
            record.revision = await kv.create(record.key, record.encode())
        except Exception as exc:
            raise TransportError(f"could not store batch: {exc!r}") from exc
        return record

    async def batch(self, tenant: str, batch_id: str) -> BatchRecord:
        if not _BATCH_ID.fullmatch(batch_id):
            raise NotFound(f"no batch {batch_id[:80]!r}", param="batch_id")
        kv, _ = await self._open()
        entry = await self._get(kv, f"batch.{_tenant(tenant)}.{batch_id}")
        if entry is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return BatchRecord.decode(*entry)

    async def batches(self, tenant: str | None = None) -> list[BatchRecord]:
        """A tenant's batches (None: every tenant's, for the runner)."""
        kv, _ = await self._open()
        pattern = "batch.*.*" if tenant is None else f"batch.{_tenant(tenant)}.*"
        return [BatchRecord.decode(v, rev) for v, rev in await self._scan(kv, pattern)]

    async def update(self, record: BatchRecord) -> BatchRecord:
        """Write ``record`` if nobody changed it since it was read; :class:`Conflict` otherwise."""
        kv, _ = await self._open()
        try:
            record.revision = await kv.update(record.key, record.encode(), last=record.revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise Conflict(f"batch {record.batch.id} changed meanwhile") from exc
        except nats.js.errors.APIError as exc:
            if exc.err_code == 10071:  # wrong last sequence, as some servers word it
                raise Conflict(f"batch {record.batch.id} changed meanwhile") from exc
            raise TransportError(f"could not update batch: {exc!r}") from exc
        except Exception as exc:
            raise TransportError(f"could not update batch: {exc!r}") from exc
        return record

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    async def _get(kv: KeyValue, key: str) -> tuple[bytes, int] | None:
        """One record, read through a cluster's election (a read is idempotent): a relay whose NATS
        node died answered 503 to a client polling its batch while the bucket had no leader."""

        async def once() -> tuple[bytes, int] | None:
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return None
            return (entry.value or b""), int(entry.revision or 0)

        try:
            return await through_elections(once)
        except Exception as exc:
            raise TransportError(f"could not read the Batch API's records: {exc!r}") from exc

    async def _scan(self, kv: KeyValue, pattern: str) -> list[tuple[bytes, int]]:
        """Every live value under ``pattern``, oldest first: the stream names the keys it holds, and each
        is read by a direct get. Not a watch: nats-py's watch can signal its end before the first value
        (the server may answer its consumer-info request before it delivers), so a listing came back
        empty for a bucket that held a batch."""
        subjects = f"$KV.{BATCHES_BUCKET}.{pattern}"
        try:
            info = await through_elections(
                lambda: self._bus().js.stream_info(BATCHES_STREAM, subjects_filter=subjects))
        except (TimeoutError, nats.errors.Error) as exc:
            raise TransportError(f"could not list the Batch API's records: {exc!r}") from exc
        prefix = len(f"$KV.{BATCHES_BUCKET}.")
        keys = [subject[prefix:] for subject in info.state.subjects or {}]
        out: list[tuple[bytes, int]] = []
        for i in range(0, len(keys), _SCAN_CONCURRENCY):
            got = await asyncio.gather(*(self._get(kv, key) for key in keys[i:i + _SCAN_CONCURRENCY]))
            out.extend(entry for entry in got if entry is not None and entry[0])
        return sorted(out, key=lambda entry: entry[1])
