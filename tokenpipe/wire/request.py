"""The generation job (:class:`Request`, msgpack on the requests stream) and its parts: chat
messages and token ids.

A :class:`Request` is declared once, as a dataclass whose fields carry their pydantic bounds:
one TypeAdapter validates an untrusted map into it (the parameters' bounds are
:class:`~tokenpipe.params.SamplingParams`' own, shared with the relay's HTTP bodies, which is why
this shape is pydantic's and not a msgspec Struct) and msgspec encodes it, in field order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

import msgspec
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, StringConstraints, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs this TypedDict before Python 3.12

from ..errors import InvalidRequest
from ..params import CoalesceParams, SamplingParams, validated
from ..subjects import check_stream_id
from .codec import WIRE_VERSION, new_request_id, now_ns, pack, unpack, unpack_any

__all__ = ["DEFAULT_TIER", "SERVICE_TIERS", "Message", "MessageDict", "Request", "Role", "ServedTier", "ServiceTier",
           "TokenId", "chat_message", "peek_request_id"]

MAX_TOKEN_ID = 1 << 31  # no vocabulary is larger; keeps every id encodable
TokenId = Annotated[int, Field(strict=True, ge=0, lt=MAX_TOKEN_ID)]
Role = Literal["system", "user", "assistant", "developer", "tool"]
_Text = Annotated[str, StringConstraints(strict=True)]
_Name = Annotated[str, StringConstraints(strict=True, min_length=1)]
# A request's class of service, with OpenAI's names: ``flex`` is batch work (offline, preemptible),
# every other tier interactive (waiting interactive work is admitted first and may preempt batch rows).
ServiceTier = Literal["auto", "default", "flex", "priority"]
SERVICE_TIERS: tuple[str, ...] = get_args(ServiceTier)
DEFAULT_TIER: ServiceTier = "auto"
ServedTier = Literal["default", "flex", "priority"]  # what a response names: ``auto`` is served as ``default``
_SERVED: Mapping[str, ServedTier] = MappingProxyType({"auto": "default", "default": "default", "flex": "flex",
                                                     "priority": "priority"})


@with_config(ConfigDict(extra="ignore"))
class MessageDict(TypedDict):
    role: Role
    content: _Text


def chat_message(role: Role, content: str) -> MessageDict:
    """One chat message as the wire carries it: OpenAI's newer "developer" role is the system role."""
    return {"role": "system" if role == "developer" else role, "content": content}


Message = Annotated[MessageDict, AfterValidator(lambda m: chat_message(m["role"], m["content"]))]  # other keys dropped


def _present(value: Any) -> Any:
    """A map's null values are absent ones (its defaults): what msgpack peers and SDK callers send."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, Mapping) else value


def _params(value: Any) -> Any:
    return {} if value is None else _present(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A generation job. Exactly one of ``messages``, ``prompt``, ``input_ids`` is set."""

    v: Annotated[int, Field(strict=True, le=WIRE_VERSION)] = WIRE_VERSION
    id: _Name
    model: _Name
    prompt: _Text | None = None
    messages: Annotated[tuple[Message, ...], Field(min_length=1)] | None = None
    input_ids: tuple[TokenId, ...] | None = None
    params: Annotated[SamplingParams, BeforeValidator(_params)] = field(default_factory=SamplingParams)
    coalesce: Annotated[CoalesceParams, BeforeValidator(_params)] = field(default_factory=CoalesceParams)
    tenant: _Text = "default"
    created_at: Annotated[int, Field(strict=True)] = 0
    # Last, and left out of the encoding when it is the default: a request without it is
    # interactive, and bytes of a default request are what peers before the field wrote.
    service_tier: ServiceTier = DEFAULT_TIER
    # The OpenAI ``user`` (or the SDK's ``session``): an affinity hint for placement
    # (tokenpipe.placement), never shown to anyone else. Left out of the encoding when empty.
    session: Annotated[str, Field(max_length=256)] = ""

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.input_ids))
        if given != 1:
            raise InvalidRequest("exactly one of 'prompt', 'messages' or 'input_ids' is required")

    @property
    def prompt_chars(self) -> int:
        """The prompt's length in characters, all messages together (``input_ids``: 0, bounded in tokens)."""
        return len(self.prompt or "") + sum(len(m["content"]) for m in self.messages or ())

    @property
    def batch(self) -> bool:
        """Batch work (``flex``): admitted after waiting interactive work, preempted for it."""
        return self.service_tier == "flex"

    @property
    def served_tier(self) -> ServedTier:
        """The tier a response names, as OpenAI's do: ``auto`` is served as ``default``."""
        return _SERVED[self.service_tier]

    @classmethod
    def build(cls, model: str, *, prompt: Any = None, messages: Any = None, input_ids: Any = None,
              params: Mapping[str, Any] | None = None, coalesce: Any = None, tenant: str = "default",
              request_id: str | None = None, service_tier: Any = None, session: Any = None) -> Request:
        """A new request (a fresh id unless given, created now) from untrusted values, validated
        as :meth:`from_map` does: the producer SDK builds its requests here (the relay, with :meth:`create`)."""
        return cls.from_map({
            "id": request_id or new_request_id(), "model": model, "prompt": prompt, "messages": _listed(messages),
            "input_ids": _listed(input_ids), "params": params, "coalesce": coalesce, "tenant": tenant,
            "created_at": now_ns(), "service_tier": service_tier, "session": session,
        })

    @classmethod
    def create(cls, model: str, **kw: Any) -> Request:
        """A new request from already-typed fields (in-process callers and tests)."""
        kw.setdefault("id", new_request_id())
        kw.setdefault("created_at", now_ns())
        return cls(model=model, **kw)

    def to_map(self) -> dict[str, Any]:
        """The request as a plain map (JSON- and msgpack-ready), as :meth:`from_map` reads it; the
        default ``service_tier`` left out (see the field)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        if self.service_tier == DEFAULT_TIER:
            del out["service_tier"]
        if not self.session:
            del out["session"]
        return out

    def encode(self) -> bytes:
        return pack(self.to_map())

    @classmethod
    def decode(cls, data: bytes) -> Request:
        return cls.from_map(unpack(data, "request"))

    @classmethod
    def from_map(cls, obj: Mapping[str, Any]) -> Request:
        """Validate an untrusted map. Raises :class:`InvalidRequest` naming the offending field (a
        sampling parameter by its own name, as the HTTP bodies name it)."""
        return validated(_REQUEST, obj, "request", within="params")


_REQUEST: TypeAdapter[Request] = TypeAdapter(Annotated[Request, BeforeValidator(_present)])


def _listed(value: Any) -> Any:
    """Any other iterable as a list (an SDK caller's generator); JSON values stay as they are."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping, list, tuple)):
        return list(value)
    return value


def peek_request_id(data: bytes) -> str | None:
    """The stream id in a request that may not decode as a :class:`Request` (so that its stream
    can be told why), or None when it carries no usable one."""
    obj = unpack_any(data)
    rid = obj.get("id") if isinstance(obj, dict) else None
    try:
        return check_stream_id(rid) if isinstance(rid, str) else None
    except InvalidRequest:
        return None
