"""The wire contract: requests and token batches, msgpack-encoded and versioned.

Every message is a msgpack map with a ``v`` field. Decoders ignore unknown keys so
newer peers can add fields; ``v`` bumps only on an incompatible change. These are
pure functions over bytes: no transport is imported here.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import msgpack

from .errors import InvalidRequest, WireFormatError

__all__ = [
    "WIRE_VERSION",
    "FINISH_REASONS",
    "FinishReason",
    "SamplingParams",
    "CoalesceParams",
    "Request",
    "TokenBatch",
    "Usage",
    "new_request_id",
    "now_ns",
]

WIRE_VERSION = 1
FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "cancelled", "error"})

# Bounds that keep a single request from monopolising a worker; the relay may be stricter.
MAX_STOP_STRINGS = 8
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_TOKEN_ID = 1 << 31  # no vocabulary is larger; keeps every id encodable


def new_request_id() -> str:
    """128 random bits, URL- and subject-safe (no dots, no wildcards)."""
    return secrets.token_urlsafe(16)


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
    if version > WIRE_VERSION:
        raise WireFormatError(f"{what}: wire version {version} is newer than supported {WIRE_VERSION}")
    return obj


def _num(value: Any, name: str, *, lo: float, hi: float, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if integer and not isinstance(value, int):
        if not float(value).is_integer():
            raise InvalidRequest(f"'{name}' must be an integer", param=name)
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be finite", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", param=name)
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    @classmethod
    def from_map(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Validate and build from an untrusted map (HTTP JSON or msgpack)."""
        data = data or {}
        if not isinstance(data, Mapping):
            raise InvalidRequest("'params' must be an object", param="params")
        kw: dict[str, Any] = {}
        if data.get("max_tokens") is not None:
            kw["max_tokens"] = _num(data["max_tokens"], "max_tokens", lo=1, hi=MAX_TOKENS_LIMIT, integer=True)
        if data.get("temperature") is not None:
            kw["temperature"] = float(_num(data["temperature"], "temperature", lo=0.0, hi=2.0))
        if data.get("top_p") is not None:
            top_p = float(_num(data["top_p"], "top_p", lo=0.0, hi=1.0))
            if top_p <= 0.0:
                raise InvalidRequest("'top_p' must be greater than 0", param="top_p")
            kw["top_p"] = top_p
        if data.get("top_k") is not None:
            kw["top_k"] = _num(data["top_k"], "top_k", lo=-1, hi=1 << 20, integer=True)
            kw["top_k"] = max(kw["top_k"], 0)
        if data.get("seed") is not None:
            kw["seed"] = _num(data["seed"], "seed", lo=-(1 << 63), hi=(1 << 63) - 1, integer=True)
        if data.get("ignore_eos") is not None:
            if not isinstance(data["ignore_eos"], bool):
                raise InvalidRequest("'ignore_eos' must be a boolean", param="ignore_eos")
            kw["ignore_eos"] = data["ignore_eos"]
        stop = data.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
            if len(stop) > MAX_STOP_STRINGS:
                raise InvalidRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
            if any(not s or len(s) > MAX_STOP_LEN for s in stop):
                raise InvalidRequest(f"each stop string must have 1..{MAX_STOP_LEN} characters", param="stop")
            kw["stop"] = tuple(stop)
        return cls(**kw)

    def to_map(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out


@dataclass(frozen=True, slots=True)
class CoalesceParams:
    """Token coalescing windows; ``None`` means "use the worker's default", 0 = every token."""

    max_tokens: int | None = None
    max_delay_ms: float | None = None

    @classmethod
    def from_map(cls, data: Mapping[str, Any] | None) -> CoalesceParams:
        data = data or {}
        if not isinstance(data, Mapping):
            raise InvalidRequest("'coalesce' must be an object", param="coalesce")
        max_tokens = data.get("max_tokens")
        max_delay = data.get("max_delay_ms")
        if max_tokens is not None:
            max_tokens = _num(max_tokens, "coalesce.max_tokens", lo=0, hi=4096, integer=True)
        if max_delay is not None:
            max_delay = float(_num(max_delay, "coalesce.max_delay_ms", lo=0, hi=10_000))
        return cls(max_tokens=max_tokens, max_delay_ms=max_delay)

    def to_map(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "max_delay_ms": self.max_delay_ms}


@dataclass(frozen=True, slots=True)
class Request:
    """A generation job. Exactly one of ``messages``, ``prompt``, ``input_ids`` is set."""

    id: str
    model: str
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
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
    def create(cls, model: str, **kw: Any) -> Request:
        kw.setdefault("id", new_request_id())
        kw.setdefault("created_at", now_ns())
        return cls(model=model, **kw)

    def encode(self) -> bytes:
        return _pack(
            {
                "v": WIRE_VERSION,
                "id": self.id,
                "model": self.model,
                "prompt": self.prompt,
                "messages": [dict(m) for m in self.messages] if self.messages is not None else None,
                "input_ids": list(self.input_ids) if self.input_ids is not None else None,
                "params": self.params.to_map(),
                "coalesce": self.coalesce.to_map(),
                "tenant": self.tenant,
                "created_at": self.created_at,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Request:
        obj = _unpack(data, "request")
        return cls.from_map(obj)

    @classmethod
    def from_map(cls, obj: Mapping[str, Any]) -> Request:
        """Validate an untrusted map. Raises :class:`InvalidRequest` with the offending param."""
        rid, model = obj.get("id"), obj.get("model")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest("'id' must be a non-empty string", param="id")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' must be a non-empty string", param="model")
        prompt = obj.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        messages = _validate_messages(obj.get("messages"))
        input_ids = obj.get("input_ids")
        if input_ids is not None:
            if not isinstance(input_ids, Sequence) or isinstance(input_ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in input_ids
            ):
                raise InvalidRequest(f"'input_ids' must be a list of integers in [0, {MAX_TOKEN_ID})",
                                     param="input_ids")
            input_ids = tuple(input_ids)
        tenant = obj.get("tenant", "default")
        if not isinstance(tenant, str):
            raise InvalidRequest("'tenant' must be a string", param="tenant")
        created = obj.get("created_at") or 0
        if not isinstance(created, int) or isinstance(created, bool):
            raise InvalidRequest("'created_at' must be an integer (ns)", param="created_at")
        return cls(
            id=rid,
            model=model,
            prompt=prompt,
            messages=messages,
            input_ids=input_ids,
            params=SamplingParams.from_map(obj.get("params")),
            coalesce=CoalesceParams.from_map(obj.get("coalesce")),
            tenant=tenant,
            created_at=created,
        )


def _validate_messages(messages: Any) -> tuple[Mapping[str, str], ...] | None:
    if messages is None:
        return None
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequest(f"messages[{i}].role must be system, user, assistant or tool", param="messages")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


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
    UTF-8. ``timings`` holds wall-clock ns stamps: ``created`` (request), ``started``
    (worker dequeued), ``first_token`` (first token of this batch produced),
    ``emitted`` (batch published).
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
        """The JSON shape used by the relay's native SSE API and the replay CLI."""
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
