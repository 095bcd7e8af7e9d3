"""The wire contract: every shape that crosses a process boundary, encoded and versioned.

Requests and token batches are msgpack maps. The two control-plane shapes, a generator's
:class:`Announcement` and a stream's :class:`StreamMeta` (its entry in the meta bucket), are
JSON maps: operators read them with ``nats sub`` and ``nats kv get``, and entries written
before this module existed must stay readable. Every map has a ``v`` field (the JSON shapes
accept its absence: older peers wrote none); decoders ignore unknown keys so newer peers can
add fields, and ``v`` bumps only on an incompatible change. These are pure functions over
bytes: no transport is imported here.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import (
    Annotated,
    Any,
    Literal,
    Required,  # pydantic needs this TypedDict before Python 3.12
)

import msgpack
from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, TypeAdapter, with_config
from typing_extensions import TypedDict

from .errors import InvalidRequest, WireFormatError
from .params import CoalesceParams, SamplingParams, validated
from .subjects import check_stream_id

__all__ = [
    "WIRE_VERSION",
    "FINISH_REASONS",
    "FinishReason",
    "SamplingParams",
    "CoalesceParams",
    "Request",
    "Role",
    "Message",
    "chat_message",
    "TokenId",
    "TokenBatch",
    "Cancel",
    "Usage",
    "StreamMeta",
    "IndexedRequest",
    "Announcement",
    "new_request_id",
    "now_ns",
    "peek_request_id",
]

WIRE_VERSION = 1
FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "cancelled", "error"})

MAX_TOKEN_ID = 1 << 31  # no vocabulary is larger; keeps every id encodable
TokenId = Annotated[int, Field(strict=True, ge=0, lt=MAX_TOKEN_ID)]
Role = Literal["system", "user", "assistant", "developer", "tool"]
_Text = Annotated[str, StringConstraints(strict=True)]
_Name = Annotated[str, StringConstraints(strict=True, min_length=1)]


@with_config(ConfigDict(extra="ignore"))
class MessageDict(TypedDict):
    role: Role
    content: _Text


def chat_message(role: Role, content: str) -> MessageDict:
    """One chat message as the wire carries it: OpenAI's newer "developer" role is the system role."""
    return {"role": "system" if role == "developer" else role, "content": content}


Message = Annotated[MessageDict, AfterValidator(lambda m: chat_message(m["role"], m["content"]))]  # other keys dropped


class _RequestFields(TypedDict, total=False):
    """A :class:`Request`'s own fields as a map carries them (a null is an absent field)."""

    id: Required[_Name]
    model: Required[_Name]
    prompt: _Text
    messages: Annotated[tuple[Message, ...], Field(min_length=1)]
    input_ids: tuple[TokenId, ...]
    tenant: _Text
    created_at: Annotated[int, Field(strict=True)]


_REQUEST_FIELDS = TypeAdapter(_RequestFields)


def new_request_id() -> str:
    """About 128 random bits, URL- and subject-safe (no dots, no wildcards).

    Never starting with ``-``: such an id read as an option on a command line
    (``tokenpipe replay -x…``); redrawing those 1 in 64 costs under 0.03 bits."""
    while (rid := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return rid


def now_ns() -> int:
    return time.time_ns()


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireFormatError(f"{what}: not valid msgpack ({exc})") from exc
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireFormatError(f"{what}: missing integer version field 'v'")
    _check_version(version, what)
    return obj


def _check_version(version: int, what: str) -> None:
    if version > WIRE_VERSION:
        raise WireFormatError(f"{what}: wire version {version} is newer than supported {WIRE_VERSION}")


def _dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise WireFormatError(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("v", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireFormatError(f"{what}: version field 'v' must be an integer")
    _check_version(version, what)
    return obj


@dataclass(frozen=True, slots=True)
class Request:
    """A generation job. Exactly one of ``messages``, ``prompt``, ``input_ids`` is set."""

    id: str
    model: str
    prompt: str | None = None
    messages: tuple[MessageDict, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    coalesce: CoalesceParams = field(default_factory=CoalesceParams)
    tenant: str = "default"
    created_at: int = 0

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.input_ids))
        if given != 1:
            raise InvalidRequest("exactly one of 'prompt', 'messages' or 'input_ids' is required")

    @classmethod
    def build(cls, model: str, *, prompt: Any = None, messages: Any = None, input_ids: Any = None,
              params: Mapping[str, Any] | None = None, coalesce: Any = None, tenant: str = "default",
              request_id: str | None = None) -> Request:
        """A new request (a fresh id unless given, created now) from untrusted values, validated
        as :meth:`from_map` does. The relay and the producer SDK both build their requests here."""
        return cls.from_map({
            "id": request_id or new_request_id(), "model": model, "prompt": prompt, "messages": _listed(messages),
            "input_ids": _listed(input_ids), "params": params, "coalesce": coalesce, "tenant": tenant,
            "created_at": now_ns(),
        })

    @classmethod
    def create(cls, model: str, **kw: Any) -> Request:
        """A new request from already-typed fields (in-process callers and tests)."""
        kw.setdefault("id", new_request_id())
        kw.setdefault("created_at", now_ns())
        return cls(model=model, **kw)

    def to_map(self) -> dict[str, Any]:
        """The request as a plain map (JSON- and msgpack-ready), as :meth:`from_map` reads it."""
        return {"v": WIRE_VERSION, "id": self.id, "model": self.model, "prompt": self.prompt,
                "messages": [dict(m) for m in self.messages] if self.messages is not None else None,
                "input_ids": list(self.input_ids) if self.input_ids is not None else None,
                "params": self.params.to_map(), "coalesce": self.coalesce.to_map(), "tenant": self.tenant,
                "created_at": self.created_at}

    def encode(self) -> bytes:
        return _pack(self.to_map())

    @classmethod
    def decode(cls, data: bytes) -> Request:
        return cls.from_map(_unpack(data, "request"))

    @classmethod
    def from_map(cls, obj: Mapping[str, Any]) -> Request:
        """Validate an untrusted map. Raises :class:`InvalidRequest` with the offending param."""
        fields = validated(_REQUEST_FIELDS, {k: obj.get(k) for k in _RequestFields.__annotations__}, "request")
        return cls(**fields, params=SamplingParams.from_map(obj.get("params")),
                   coalesce=CoalesceParams.from_map(obj.get("coalesce")))


def _listed(value: Any) -> Any:
    """Any other iterable as a list (an SDK caller's generator); JSON values stay as they are."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping, list, tuple)):
        return list(value)
    return value


def peek_request_id(data: bytes) -> str | None:
    """The stream id in a request that may not decode as a :class:`Request` (so that its stream
    can be told why), or None when it carries no usable one."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    try:
        return check_stream_id(rid) if isinstance(rid, str) else None
    except InvalidRequest:
        return None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_map(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """A coalesced run of tokens for one request.

    ``seq`` numbers batches 0,1,2,...; ``index`` is the position (in generated tokens)
    of the first token here, so consecutive batches satisfy
    ``next.index == prev.index + len(prev.token_ids)``. ``text`` is always complete
    UTF-8. ``timings`` holds wall-clock ns stamps: on every batch ``first_token`` (first
    token of this batch produced) and ``emitted`` (batch published); on a request's first
    batch also ``created`` (request), ``received`` (pulled by the worker) and, once the
    engine took it, ``admitted`` (given a batch slot).
    """

    id: str
    seq: int
    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    timings: Mapping[str, int] = field(default_factory=dict)
    error_code: str | None = None  # machine-readable kind of ``error`` (e.g. "invalid_request")

    @classmethod
    def error_for(cls, stream_id: str, message: str, code: str, *, seq: int = 0, index: int = 0) -> TokenBatch:
        """The final batch that ends a stream in error, after ``seq`` batches holding ``index``
        tokens were published (0 and 0: before any)."""
        return cls(id=stream_id, seq=seq, index=index, finish="error", error=message, error_code=code,
                   usage=Usage(0, index), timings={"emitted": now_ns()})

    @property
    def is_final(self) -> bool:
        return self.finish is not None

    def encode(self) -> bytes:
        return _pack(
            {
                "v": WIRE_VERSION,
                "id": self.id,
                "seq": self.seq,
                "index": self.index,
                "token_ids": list(self.token_ids),
                "text": self.text,
                "finish": self.finish,
                "error": self.error,
                "usage": self.usage.to_map() if self.usage else None,
                "timings": dict(self.timings),
                "error_code": self.error_code,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> TokenBatch:
        obj = _unpack(data, "token batch")
        try:
            finish = obj.get("finish")
            if finish is not None and finish not in FINISH_REASONS:
                raise WireFormatError(f"token batch: unknown finish reason {finish!r}")
            usage = obj.get("usage")
            return cls(
                id=str(obj["id"]),
                seq=int(obj["seq"]),
                index=int(obj["index"]),
                token_ids=tuple(int(t) for t in obj.get("token_ids") or ()),
                text=str(obj.get("text") or ""),
                finish=finish,
                error=obj.get("error"),
                usage=Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"])) if usage else None,
                timings={str(k): int(v) for k, v in (obj.get("timings") or {}).items()},
                error_code=obj.get("error_code"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"token batch: bad field ({exc})") from exc

    def to_json(self) -> dict[str, Any]:
        """One JSON object per batch, as ``tokenpipe replay --json`` and ``tokenpipe submit --json``
        print it (the native SSE API's events have their own shape: see ``relay/native.py``)."""
        out: dict[str, Any] = {
            "id": self.id,
            "seq": self.seq,
            "index": self.index,
            "token_ids": list(self.token_ids),
            "text": self.text,
        }
        if self.finish is not None:
            out["finish"] = self.finish
        if self.error is not None:
            out["error"] = self.error
            out["error_code"] = self.error_code
        if self.usage is not None:
            out["usage"] = self.usage.to_map()
        if self.timings:
            out["timings"] = dict(self.timings)
        return out


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """Who owns a stream: its entry in the meta bucket, keyed by stream id (JSON)."""

    id: str
    tenant: str
    model: str
    created_at: int

    def encode(self) -> bytes:
        return _dump_json({"v": WIRE_VERSION, "id": self.id, "tenant": self.tenant, "model": self.model,
                           "created_at": self.created_at})

    @classmethod
    def decode(cls, data: bytes) -> StreamMeta:
        obj = _load_json(data, "stream meta")
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
        return _dump_json({"v": WIRE_VERSION, "type": "cancel", "id": self.id, "owner": self.owner})

    @classmethod
    def decode(cls, data: bytes) -> Cancel:
        obj = _load_json(data, "cancel")
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
        return _dump_json({"v": WIRE_VERSION, "request": self.request.to_map(), "traceparent": self.traceparent})

    @classmethod
    def decode(cls, data: bytes) -> IndexedRequest:
        obj = _load_json(data, "indexed request")
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
        return _dump_json({"v": WIRE_VERSION, "worker": self.worker, "model": self.model, "ready": self.ready,
                           "max_batch": self.max_batch, "running": self.running, "active": self.active,
                           "pid": self.pid, "streams": list(self.streams), "device": self.device,
                           "ttl_s": self.ttl_s, "ts": self.ts, "free_blocks": self.free_blocks,
                           "block_size": self.block_size})

    @classmethod
    def decode(cls, data: bytes) -> Announcement:
        obj = _load_json(data, "announcement")
        try:
            return cls(worker=str(obj["worker"]), model=str(obj["model"]), ready=bool(obj.get("ready", True)),
                       max_batch=int(obj.get("max_batch", 0)), running=int(obj.get("running", 0)),
                       active=int(obj.get("active", 0)), pid=int(obj.get("pid", 0)),
                       streams=tuple(str(s) for s in obj.get("streams") or ()), device=str(obj.get("device", "")),
                       ttl_s=float(obj.get("ttl_s", 6.0)), ts=float(obj.get("ts", 0.0)),
                       free_blocks=int(obj.get("free_blocks", 0)), block_size=int(obj.get("block_size", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"announcement: bad field ({exc})") from exc
