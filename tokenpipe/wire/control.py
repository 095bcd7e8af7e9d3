"""The control plane's shapes, JSON so operators read them with ``nats sub`` and ``nats kv get``:
a stream's owner (:class:`StreamMeta`), its index entry (:class:`IndexedRequest`), a
:class:`Cancel`, and a generator's :class:`Announcement`. Entries written before the version field
existed stay readable."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequest, WireFormatError
from .codec import WIRE_VERSION, dump_json, load_json
from .request import Request

__all__ = ["Announcement", "Cancel", "IndexedRequest", "StreamMeta"]


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """Who owns a stream: its entry in the meta bucket, keyed by stream id (JSON)."""

    id: str
    tenant: str
    model: str
    created_at: int

    def encode(self) -> bytes:
        return dump_json({"v": WIRE_VERSION, "id": self.id, "tenant": self.tenant, "model": self.model,
                          "created_at": self.created_at})

    @classmethod
    def decode(cls, data: bytes) -> StreamMeta:
        obj = load_json(data, "stream meta")
        try:
            return cls(id=str(obj["id"]), tenant=str(obj["tenant"]), model=str(obj["model"]),
                       created_at=int(obj["created_at"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"stream meta: bad field ({exc})") from exc


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop generating stream ``id``: published by its ``owner`` on ``tp.cancel.<owner>.<id>``
    (JSON). A generator acts only on one that names the subject's owner and stream; anything else
    there (a server's answer provoked onto the subject with a forged reply subject, junk, an empty
    message) is dropped and counted."""

    id: str
    owner: str

    def encode(self) -> bytes:
        return dump_json({"v": WIRE_VERSION, "type": "cancel", "id": self.id, "owner": self.owner})

    @classmethod
    def decode(cls, data: bytes) -> Cancel:
        obj = load_json(data, "cancel")
        sid, owner = obj.get("id"), obj.get("owner")
        if obj.get("type") != "cancel" or not isinstance(sid, str) or not isinstance(owner, str):
            raise WireFormatError('cancel: expected {"type": "cancel", "id": <stream id>, "owner": <owner>}')
        return cls(id=sid, owner=owner)


@dataclass(frozen=True, slots=True)
class IndexedRequest:
    """A relay stream's entry in its tenant's index (meta bucket, :mod:`tokenpipe.streamindex`): the
    request as submitted and the W3C ``traceparent`` of the span that submitted it (JSON)."""

    request: Request
    traceparent: str = ""

    def encode(self) -> bytes:
        return dump_json({"v": WIRE_VERSION, "request": self.request.to_map(), "traceparent": self.traceparent})

    @classmethod
    def decode(cls, data: bytes) -> IndexedRequest:
        obj = load_json(data, "indexed request")
        request = obj.get("request")
        if not isinstance(request, dict):
            raise WireFormatError("indexed request: 'request' must be an object")
        try:
            return cls(request=Request.from_map(request), traceparent=str(obj.get("traceparent") or ""))
        except InvalidRequest as exc:
            raise WireFormatError(f"indexed request: {exc.message}") from exc


@dataclass(frozen=True, slots=True)
class Announcement:
    """A generator saying it serves ``model`` (``ready``) or is leaving, and how loaded it is.

    Published on ``tp.gen.announce.<worker>`` every few seconds and in answer to
    ``tp.gen.discover`` (JSON); a relay forgets it ``ttl_s`` seconds after the last one.
    """

    worker: str
    model: str
    ready: bool = True
    max_batch: int = 0
    running: int = 0
    active: int = 0
    pid: int = 0
    streams: tuple[str, ...] = ()  # which worker holds which stream, for operators and tests
    device: str = ""
    ttl_s: float = 6.0
    ts: float = 0.0  # wall-clock seconds when sent
    free_blocks: int = 0  # KV-cache blocks a new sequence could get now (free or cached, unheld)
    block_size: int = 0  # positions per KV block

    def encode(self) -> bytes:
        return dump_json({"v": WIRE_VERSION, "worker": self.worker, "model": self.model, "ready": self.ready,
                          "max_batch": self.max_batch, "running": self.running, "active": self.active,
                          "pid": self.pid, "streams": list(self.streams), "device": self.device,
                          "ttl_s": self.ttl_s, "ts": self.ts, "free_blocks": self.free_blocks,
                          "block_size": self.block_size})

    @classmethod
    def decode(cls, data: bytes) -> Announcement:
        obj = load_json(data, "announcement")
        try:
            return cls(worker=str(obj["worker"]), model=str(obj["model"]), ready=bool(obj.get("ready", True)),
                       max_batch=int(obj.get("max_batch", 0)), running=int(obj.get("running", 0)),
                       active=int(obj.get("active", 0)), pid=int(obj.get("pid", 0)),
                       streams=tuple(str(s) for s in obj.get("streams") or ()), device=str(obj.get("device", "")),
                       ttl_s=float(obj.get("ttl_s", 6.0)), ts=float(obj.get("ts", 0.0)),
                       free_blocks=int(obj.get("free_blocks", 0)), block_size=int(obj.get("block_size", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"announcement: bad field ({exc})") from exc
