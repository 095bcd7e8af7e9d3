"""The WebSocket frames of the relay's ``/v1/ws`` (README, "WebSocket"), declared once for both ends:
the relay validates client frames and encodes server frames here, the producer SDK
(``producer.RelaySocket``) encodes client frames and decodes server frames here.

Each direction is a pydantic union discriminated by ``type``. Frames are JSON text; a client frame's
``ref`` comes back in its reply. The frames are pydantic models (not msgspec Structs like the NATS
shapes): a ``create`` frame's body is the HTTP create body (``relay.protocol.NativeCreate``) and an
``attach`` frame's fields follow the SSE route's query rules, both pydantic, and their errors name
the field the same way.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from ..errors import InvalidRequest
from ..params import Flag, invalid_request

__all__ = ["ID_PATTERN", "MAX_SEQ", "MIN_SPEED", "MAX_SPEED", "Speed", "Ref", "AuthFrame", "CreateFrame",
           "AttachFrame", "CancelFrame", "PingFrame", "ClientFrame", "AuthenticatedFrame", "PongFrame",
           "CreatedFrame", "AttachedFrame", "CancelledFrame", "TokensFrame", "GapFrame", "DoneFrame",
           "StreamErrorFrame", "ErrorFrame", "ServerFrame", "StreamFrame", "parse_client_frame", "ref_of",
           "server_frame", "parse_server_frame"]

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # stream ids and model names: NATS subject tokens
MAX_SEQ = 10**18 - 1  # the largest Last-Event-ID / last_event_id / after_seq (18 digits)
MIN_SPEED, MAX_SPEED = Decimal("0.01"), Decimal(1000)  # replay pacing factors; 0 = as fast as possible
_MAX_REF_CHARS = 256
UNKNOWN_TYPE = "unknown frame 'type': expected auth, create, attach, cancel or ping"


def _speed(value: Any) -> Any:
    """0 (as fast as possible) or within [MIN_SPEED, MAX_SPEED], so that a replay always ends.
    Judged on the exact decimal: a speed that underflows to 0.0 as a float (``1e-400``) is out
    of range, not "as fast as possible"."""
    try:
        exact = Decimal(str(value).strip())
    except InvalidOperation:
        exact = Decimal("NaN")
    if not exact.is_finite() or not (exact == 0 or MIN_SPEED <= exact <= MAX_SPEED):
        raise ValueError(f"must be 0 (as fast as possible) or between {MIN_SPEED} and {MAX_SPEED}")
    return float(exact)


def _a_number(value: Any) -> Any:
    """A JSON number (an exact one when the frame was read with decimals), never a string or a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise ValueError("must be a number")
    return value


def _one_ref(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError as exc:
        raise PydanticCustomError("ref", f"must be a string (at most {_MAX_REF_CHARS} characters) or an integer"
                                  ) from exc


# The replay ``speed`` of the SSE route's query and of an attach frame.
Speed = Annotated[float, BeforeValidator(_speed), WithJsonSchema({"anyOf": [
    {"const": 0}, {"type": "number", "minimum": float(MIN_SPEED), "maximum": float(MAX_SPEED)}]})]
# A client frame's ``ref``, echoed in its reply: a short string or an integer a JSON peer reads exactly.
Ref = Annotated[Annotated[str, StringConstraints(strict=True, max_length=_MAX_REF_CHARS)]
                | Annotated[int, Field(strict=True, gt=-(2**53), lt=2**53)] | None, WrapValidator(_one_ref)]
_StreamId = Annotated[str, StringConstraints(strict=True, pattern=ID_PATTERN)]


# -- client → relay -------------------------------------------------------------------------------
class _ClientFrame(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    ref: Ref = None

    def encode(self) -> str:
        return self.model_dump_json(exclude_none=True)


class AuthFrame(_ClientFrame):
    """The socket's API key, when the upgrade request had no ``Authorization`` header."""

    type: Literal["auth"] = "auth"
    api_key: str | None = None


class CreateFrame(_ClientFrame):
    """A new stream: every other field is the native create body (``POST /v1/streams``), validated
    as that route validates it, with this relay's limits (``relay.protocol.Bodies``): ``service_tier``
    (``flex`` for batch work) included."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["create"] = "create"

    @property
    def body(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class CancelFrame(_ClientFrame):
    """Cancel a stream this socket's tenant owns (the owner's ``DELETE``)."""

    type: Literal["cancel"] = "cancel"
    id: _StreamId


class AttachFrame(_ClientFrame):
    """Follow (or replay) a stream: the SSE route's query parameters, as strict JSON values."""

    type: Literal["attach"] = "attach"
    id: _StreamId
    after_seq: Annotated[int, Field(strict=True, ge=0, le=MAX_SEQ)] | None = None
    replay: Flag = False
    speed: Annotated[Speed, BeforeValidator(_a_number)] = 1.0  # the SSE route's ``speed`` rule
    cancel_on_disconnect: Flag = True


class PingFrame(_ClientFrame):
    type: Literal["ping"] = "ping"


ClientFrame = Annotated[AuthFrame | CreateFrame | AttachFrame | CancelFrame | PingFrame, Field(discriminator="type")]
_CLIENT: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)
_REF: TypeAdapter[Ref] = TypeAdapter(Ref)


def parse_client_frame(obj: Any) -> ClientFrame:
    """A client frame (parsed JSON) as its model, or an :class:`InvalidRequest` naming the field."""
    try:
        return _CLIENT.validate_python(obj)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0]["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise InvalidRequest(UNKNOWN_TYPE, param="type") from exc
        raise invalid_request(errors, skip=1) from exc  # the location's first part is the frame's type


def ref_of(obj: Any) -> Ref:
    """The ``ref`` of a frame that did not validate, when it is a usable one (its error echoes it)."""
    try:
        return _REF.validate_python(obj.get("ref") if isinstance(obj, dict) else None)
    except ValidationError:
        return None


# -- relay → client -------------------------------------------------------------------------------
class _ServerFrame(BaseModel):
    """A server frame. Replies drop their null fields; a stream's frames carry exactly the SSE
    event's data, nulls included (``relay.native.batch_events``). Unknown fields are kept, so
    that a reader passes on what a newer relay sends."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: str
    _keep_nulls: ClassVar[bool] = False
    _seq_in_data: ClassVar[bool] = False

    def encode(self) -> str:
        return self.model_dump_json(exclude_none=not self._keep_nulls)

    def event(self) -> tuple[str, dict[str, Any], str | None]:
        """The SSE event a stream's frame mirrors: (name, data, SSE id); the data holds the fields
        the frame came with (a decoded frame: exactly those the relay sent), less its type and id."""
        exclude = {"type", "id"} if self._seq_in_data else {"type", "id", "seq"}
        data = self.model_dump(exclude_unset=True, exclude=exclude)
        seq = getattr(self, "seq", None)
        return self.type, data, None if seq is None else str(seq)


class _Reply(_ServerFrame):
    ref: Ref = None


class AuthenticatedFrame(_Reply):
    type: Literal["authenticated"] = "authenticated"


class PongFrame(_Reply):
    type: Literal["pong"] = "pong"


class _StreamReply(_Reply):
    id: str  # the stream the frame created, attached or cancelled


class CreatedFrame(_StreamReply):
    type: Literal["created"] = "created"
    model: str
    service_tier: str | None = None  # the tier it is served at, as the HTTP create's reply names it


class AttachedFrame(_StreamReply):
    type: Literal["attached"] = "attached"


class CancelledFrame(_StreamReply):
    type: Literal["cancelled"] = "cancelled"


class ErrorFrame(_Reply):
    """A frame refused (``ref``), or a stream ended by an error of the relay's own (``id``): the
    HTTP error body's fields, plus the status and the ``retry_after`` of a 429."""

    type: Literal["error"] = "error"
    id: str | None = None
    code: str
    message: str
    param: str | None = None
    status: int = 500
    retry_after: int | None = None


class _StreamFrame(_ServerFrame):
    """One of a stream's SSE events, as a frame: ``type`` is the event's name, ``id`` the stream's;
    ``seq``, the SSE event's id, is in its data only where the SSE data has it too."""

    id: str


class TokensFrame(_StreamFrame):
    type: Literal["tokens"] = "tokens"
    _keep_nulls: ClassVar[bool] = True
    _seq_in_data: ClassVar[bool] = True
    seq: int
    index: int
    token_ids: list[int]
    text: str
    timings: dict[str, int]


class GapFrame(_StreamFrame):
    type: Literal["gap"] = "gap"
    from_seq: int
    to_seq: int
    message: str


class DoneFrame(_StreamFrame):
    type: Literal["done"] = "done"
    _keep_nulls: ClassVar[bool] = True
    seq: int
    finish: str
    usage: dict[str, int] | None = None


class StreamErrorFrame(_StreamFrame):
    """The stream's final batch ended it in error (the SSE ``error`` event, with the batch's ``seq``)."""

    type: Literal["error"] = "error"
    _keep_nulls: ClassVar[bool] = True
    seq: int
    message: str
    code: str | None = None
    finish: Literal["error"] = "error"
    usage: dict[str, int] | None = None


def _server_tag(frame: Any) -> str | None:
    """A server frame's kind: its ``type``, and an ``error`` with a ``seq`` is a stream's final event."""
    kind = frame.get("type") if isinstance(frame, dict) else getattr(frame, "type", None)
    has_seq = "seq" in frame if isinstance(frame, dict) else isinstance(frame, StreamErrorFrame)
    return "stream-error" if kind == "error" and has_seq else kind


ServerFrame = Annotated[
    Annotated[AuthenticatedFrame, Tag("authenticated")] | Annotated[PongFrame, Tag("pong")]
    | Annotated[CreatedFrame, Tag("created")] | Annotated[AttachedFrame, Tag("attached")]
    | Annotated[CancelledFrame, Tag("cancelled")] | Annotated[ErrorFrame, Tag("error")]
    | Annotated[TokensFrame, Tag("tokens")] | Annotated[GapFrame, Tag("gap")] | Annotated[DoneFrame, Tag("done")]
    | Annotated[StreamErrorFrame, Tag("stream-error")],
    Discriminator(_server_tag)]
StreamFrame = TokensFrame | GapFrame | DoneFrame | StreamErrorFrame
_SERVER: TypeAdapter[ServerFrame] = TypeAdapter(ServerFrame)


def server_frame(fields: dict[str, Any]) -> ServerFrame:
    """A server frame from its fields (``type`` picks the kind): how the relay builds a stream's
    frames from the SSE events' data."""
    return _SERVER.validate_python(fields)


def parse_server_frame(text: str | bytes) -> ServerFrame | None:
    """A frame the relay sent, or None for one this side does not know (a newer relay's)."""
    try:
        return _SERVER.validate_json(text)
    except ValidationError:
        return None
