"""The control plane's shapes, JSON so operators read them with ``nats sub`` and ``nats kv get``:
a stream's owner (:class:`StreamMeta`), its index entry (:class:`IndexedRequest`), a
:class:`Cancel`, and a generator's :class:`Announcement`. Entries written before the version field
existed stay readable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

from ..errors import InvalidRequest, WireFormatError
from .codec import WIRE_VERSION, dump_json, load_json
from .request import Request

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Announcement", "Cancel", "IndexedRequest", "StreamMeta"]

# How a field of each declared type is read from JSON (a field's type is its annotation's text).
_READ: dict[str, Callable[[Any], Any]] = {"str": str, "int": int, "float": float, "bool": bool,
                                          "tuple[str, ...]": lambda v: tuple(str(s) for s in v or ())}


class _Flat:
    """A flat shape (:class:`StreamMeta`, :class:`Announcement`): its JSON map is its fields, each
    read back as its declared type, an absent one its default. ``_what`` names it in errors."""

    __slots__ = ()
    _what: ClassVar[str]

    def encode(self: DataclassInstance) -> bytes:
        return dump_json({"v": WIRE_VERSION, **{f.name: getattr(self, f.name) for f in fields(self)}})

    @classmethod
    def decode(cls, data: bytes) -> Self:
        obj = load_json(data, cls._what)
        try:
            return cls(**{f.name: _READ[str(f.type)](obj[f.name]) for f in fields(cls)  # type: ignore[arg-type]
                          if f.name in obj or f.default is MISSING})
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"{cls._what}: bad field ({exc})") from exc


@dataclass(frozen=True, slots=True)
class StreamMeta(_Flat):
    """Who owns a stream: its entry in the meta bucket, keyed by stream id (JSON)."""

    _what = "stream meta"
    id: str
    tenant: str
    model: str
    created_at: int


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
class Announcement(_Flat):
    """A generator saying it serves ``model`` (``ready``) or is leaving, and how loaded it is.

    Published on ``tp.gen.announce.<worker>`` every few seconds and in answer to
    ``tp.gen.discover`` (JSON); a relay forgets it ``ttl_s`` seconds after the last one.
    """

    _what = "announcement"
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
