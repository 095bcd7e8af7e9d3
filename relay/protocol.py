"""The relay's HTTP protocol, declared once: typed request and response bodies, from which FastAPI
validates requests and writes the OpenAPI document. The sampling fields are
:class:`~tokenpipe.wire.SamplingParams`' own, bounds included, each made optional; a body becomes
the wire request in one place (``_wire``). :class:`Bodies` carries one app's limits into its
document, so that the document states what the app enforces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar, get_type_hints

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from tokenpipe.errors import InvalidRequest
from tokenpipe.params import MAX_TOKENS_LIMIT, MaxTokens, Whole, invalid_request
from tokenpipe.settings import Settings
from tokenpipe.wire import CoalesceParams, Message, Role, SamplingParams, ServedTier, ServiceTier, TokenId, chat_message
from tokenpipe.wire import Request as TpRequest
from tokenpipe.wire.frames import ID_PATTERN

__all__ = ["Bodies", "NativeCreate", "ChatCompletionRequest", "CompletionRequest", "StreamCreated",
           "StreamCancelled", "ModelList", "ModelCard", "ChatCompletion", "Completion", "Usage", "ErrorResponse",
           "NativeEvent", "OpenAIEvent", "ERROR_STATUSES", "ID_PATTERN", "parse"]

StreamId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
Text = Annotated[str, StringConstraints(strict=True)]
PromptText = Annotated[str, StringConstraints(strict=True, min_length=1)]  # an empty prompt has nothing to continue
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Flag = Annotated[bool, Field(strict=True)]
B = TypeVar("B", bound="_Create")
M = TypeVar("M", bound=BaseModel)
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))

if TYPE_CHECKING:
    class _Sampling(BaseModel):
        max_tokens: int | None
else:  # from SamplingParams: a new sampling field is in every body, and in the document, with its bounds
    _hints = get_type_hints(SamplingParams, include_extras=True)
    _Sampling = create_model("Sampling", **{name: (_hints[name] | None, None) for name in SAMPLING_FIELDS})


class _Create(_Sampling):
    max_tokens_cap: ClassVar[int] = MAX_TOKENS_LIMIT  # this relay's limits, set by Bodies
    max_prompt_chars: ClassVar[int] = 1 << 62
    service_tier: ServiceTier | None = Field(
        None, description="class of service: `flex` is batch work (served after interactive work, preempted "
                          "for it); `auto` (the default), `default` and `priority` are interactive")
    user: Annotated[str, StringConstraints(strict=True, max_length=256)] | None = Field(
        None, description="the end user or conversation: an affinity hint, so that its requests go to the generator "
                          "that holds their history's cache")

    def _wire(self, *, model: str, tenant: str, max_tokens: int | None = None, prompt: str | None = None,
              messages: Sequence[Mapping[str, Any]] | None = None, input_ids: list[int] | None = None,
              coalesce: CoalesceParams | None = None) -> TpRequest:
        """The one place an HTTP body becomes a wire :class:`~tokenpipe.wire.Request`."""
        if len(prompt or "") + sum(len(m["content"]) for m in messages or ()) > self.max_prompt_chars:
            raise InvalidRequest(f"the prompt exceeds {self.max_prompt_chars} characters",  # all messages together
                                 param="messages" if messages is not None else "prompt")
        sampling = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        sampling["max_tokens"] = max_tokens or min(SamplingParams().max_tokens, self.max_tokens_cap)
        return TpRequest.create(model, prompt=prompt, input_ids=tuple(input_ids) if input_ids is not None else None,
                                messages=tuple(messages) if messages is not None else None, tenant=tenant,
                                params=SamplingParams(**sampling), coalesce=coalesce or CoalesceParams(),
                                service_tier=self.service_tier or "auto", session=self.user or "")


class NativeCreate(_Create):
    """``POST /v1/streams`` (and the WebSocket ``create`` frame): exactly one of ``prompt``,
    ``messages``, ``input_ids``; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
    model: StreamId | None = None
    prompt: PromptText | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    input_ids: TokenIds | None = None
    coalesce: CoalesceParams | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> NativeCreate:
        if sum(x is not None for x in (self.prompt, self.messages, self.input_ids)) != 1:
            raise ValueError("exactly one of 'prompt', 'messages' or 'input_ids' is required")
        return self

    def to_request(self, model: str, tenant: str) -> TpRequest:
        return self._wire(model=model, tenant=tenant, max_tokens=self.max_tokens, prompt=self.prompt,
                          messages=self.messages, input_ids=self.input_ids, coalesce=self.coalesce)


def _neutral(value: Any) -> Any:
    def check(given: Any, info: ValidationInfo) -> Any:
        if given is not None and given != value and not (info.field_name == "response_format" and
                                                         given == {"type": "text"}):
            raise ValueError(f"'{info.field_name}' is not supported by this server")
        return given
    return (SkipJsonSchema[Annotated[Any, AfterValidator(check)]], None)  # type: ignore[misc]


# OpenAI fields accepted only with the value that changes nothing (left out of the document).
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "parallel_tool_calls": None,
            "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None, "echo": False,
            "best_of": 1, "suffix": None, "top_logprobs": None, "store": None,
            "metadata": None, "prediction": None, "modalities": None, "reasoning_effort": None}
if TYPE_CHECKING:
    _OpenAIFields = _Create
else:
    _OpenAIFields = create_model("OpenAIFields", __base__=_Create, **{k: _neutral(v) for k, v in _NEUTRAL.items()})


class StreamOptions(BaseModel):
    include_usage: Flag = False


class _OpenAIRequest(_OpenAIFields):
    """OpenAI's fields; the unsupported ones are accepted only with their neutral value, unknown ones are ignored."""

    model_config = ConfigDict(json_schema_extra={  # what _only_streaming checks, in the document's words
        "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}})
    model: Text | None = Field(None, description="a served model (else 404)")
    stream: Flag | None = None
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    n: Annotated[int, Whole(1, 1)] | None = None
    max_completion_tokens: MaxTokens | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wire_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


def _one_of(what: str) -> WrapValidator:
    """A union's error in one sentence (pydantic lists each alternative's failure)."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            raise PydanticCustomError("union", "must be {what} ({detail})",
                                      {"what": what, "detail": exc.errors()[0]["msg"]}) from exc
    return WrapValidator(validate)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Role
    content: Annotated[Text | list[TextPart], _one_of("a string or a list of text parts")]

    @model_validator(mode="before")
    @classmethod
    def _assistant_may_be_empty(cls, data: Any) -> Any:  # an assistant turn that only called tools
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("content") is None:
            return {**data, "content": ""}
        return data


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]

    def to_request(self, model: str, tenant: str) -> TpRequest:
        texts = [m.content if isinstance(m.content, str) else "".join(p.text for p in m.content) for m in self.messages]
        messages = [chat_message(m.role, text) for m, text in zip(self.messages, texts, strict=True)]
        return self._wire(model=model, tenant=tenant, max_tokens=self.wire_max_tokens, messages=messages)


def _completion_prompt(text: Any) -> Any:
    return Annotated[text | Annotated[list[text], Field(min_length=1, max_length=1)] | TokenIds,  # type: ignore[misc]
                     _one_of("a string, a list with one string, or a list of token ids")]


class CompletionRequest(_OpenAIRequest):
    prompt: _completion_prompt(PromptText)  # type: ignore[valid-type]

    def to_request(self, model: str, tenant: str) -> TpRequest:
        prompt = self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) else self.prompt
        if isinstance(prompt, str):
            return self._wire(model=model, tenant=tenant, max_tokens=self.wire_max_tokens, prompt=prompt)
        return self._wire(model=model, tenant=tenant, max_tokens=self.wire_max_tokens, input_ids=prompt)


class Bodies:
    """The request body models one relay serves (``app.state.bodies``): the shared ones with
    this relay's limits."""

    def __init__(self, settings: Settings) -> None:
        cap = min(settings.max_tokens_cap, MAX_TOKENS_LIMIT)
        tokens: Any = (Annotated[int, Whole(1, cap)] | None, None)
        prompt = Annotated[PromptText, StringConstraints(max_length=settings.max_prompt_chars)]

        def limited(base: type[B], **fields: Any) -> type[B]:
            model = create_model(base.__name__, __base__=base, __module__=__name__, max_tokens=tokens, **fields)
            model.max_tokens_cap, model.max_prompt_chars = cap, settings.max_prompt_chars
            return model

        self.native = limited(NativeCreate, prompt=(prompt | None, None))
        self.chat = limited(ChatCompletionRequest, max_completion_tokens=tokens)
        self.completion = limited(CompletionRequest, max_completion_tokens=tokens,
                                  prompt=(_completion_prompt(prompt), ...))

    def parse_native(self, body: Any) -> NativeCreate:
        """A native create body (a WebSocket ``create`` frame) validated as ``POST /v1/streams`` validates it."""
        return parse(self.native, body)


def parse(model: type[M], body: Any) -> M:
    """``body`` (parsed JSON) as ``model``, or an :class:`InvalidRequest` naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from exc


# --- responses --------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                  "rate_limit_error", "service_unavailable_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, on every 4xx and 5xx."""

    error: ErrorDetail


# Every status an API route may answer with besides its success, each with the OpenAI error body.
ERROR_STATUSES = {
    400: "invalid request (bad JSON, bad field, lone surrogate, out-of-range number, bad query value)",
    401: "missing or invalid API key",
    404: "no such route, stream or model",
    405: "method not allowed on this route",
    413: "request body too large",
    422: "request refused as unprocessable",
    429: "too many unfinished streams for this key, or the model's queue is too deep",
    503: "no generator serves the model, or NATS is unreachable",
}


class StreamCreated(BaseModel):
    id: StreamId
    model: str
    stream_url: str
    service_tier: ServedTier


class StreamCancelled(BaseModel):
    id: str
    cancelled: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "tokenpipe"
    created: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int = 0
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class CompletionChoice(_Choice):
    text: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    service_tier: ServedTier


class ChatCompletion(Completion):
    object: Literal["chat.completion"] = "chat.completion"  # type: ignore[assignment]
    choices: list[ChatChoice]  # type: ignore[assignment]


# Before OpenAPI 3.2 a ``text/event-stream`` schema describes one event (as schemathesis reads it).
class NativeEvent(BaseModel):
    """One event of a native stream; ``data`` is JSON (``tokens``, ``done``, ``error``, ``gap``)."""

    event: Literal["tokens", "done", "error", "gap"]
    data: str
    id: Annotated[str, StringConstraints(pattern=r"^[0-9]+$")] | None = None


class OpenAIEvent(BaseModel):
    """One OpenAI stream event: ``data`` is a chunk as JSON, or ``[DONE]``."""

    event: Literal["message"] | None = None
    data: str
