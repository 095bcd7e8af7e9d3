"""The generation job (:class:`Request`, msgpack on the requests stream) and its parts: chat
messages and token ids, validated by pydantic from untrusted maps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import (
    Annotated,
    Any,
    Literal,
    Required,  # pydantic needs this TypedDict before Python 3.12
)

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, TypeAdapter, with_config
from typing_extensions import TypedDict

from ..errors import InvalidRequest
from ..params import CoalesceParams, SamplingParams, validated
from ..subjects import check_stream_id
from .codec import WIRE_VERSION, new_request_id, now_ns, pack, unpack, unpack_any

__all__ = ["Message", "MessageDict", "Request", "Role", "TokenId", "chat_message", "peek_request_id"]

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
        as :meth:`from_map` does: the producer SDK builds its requests here (the relay, with :meth:`create`)."""
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
        return pack(self.to_map())

    @classmethod
    def decode(cls, data: bytes) -> Request:
        return cls.from_map(unpack(data, "request"))

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
    obj = unpack_any(data)
    rid = obj.get("id") if isinstance(obj, dict) else None
    try:
        return check_stream_id(rid) if isinstance(rid, str) else None
    except InvalidRequest:
        return None
