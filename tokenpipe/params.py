"""Request parameters: sampling and token coalescing, each field declared once with its bounds.

Part of the wire contract: :mod:`tokenpipe.wire` carries them inside a :class:`Request` and
re-exports them (import them from there). The bounds are pydantic annotations on plain
dataclasses: the wire decoder validates an untrusted msgpack map against them (``from_map``),
the relay's HTTP models take the same fields (``relay/protocol.py``) and its OpenAPI document
shows them, so a new sampling field is one line here (and its use in the generator).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Any, TypeVar

from annotated_types import GroupedMetadata
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    with_config,
)

from .errors import InvalidRequest

__all__ = ["SamplingParams", "CoalesceParams", "MAX_STOP_STRINGS", "MAX_STOP_LEN", "MAX_TOKENS_LIMIT", "Whole",
           "validated", "invalid_request"]

# Bounds that keep a single request from monopolising a worker; the relay may be stricter.
MAX_STOP_STRINGS = 8
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1 << 20

T = TypeVar("T")


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True, slots=True)
class Whole(GroupedMetadata):
    """An integer in ``[lo, hi]``: ``5.0`` is the integer 5 (as JSON Schema says); ``5.5``,
    ``"5"`` and ``True`` are not integers."""

    lo: int
    hi: int

    def __iter__(self) -> Iterator[object]:
        yield Field(strict=True, ge=self.lo, le=self.hi)
        yield BeforeValidator(_integral)


def _listed(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


# Strict: a string, a bool or NaN is never a number here.
MaxTokens = Annotated[int, Whole(1, MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(strict=True, ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Whole(-1, 1 << 20), AfterValidator(lambda k: max(k, 0))]  # -1 means "off", as in OpenAI's
Seed = Annotated[int, Whole(-(1 << 63), (1 << 63) - 1)]
StopString = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_STOP_LEN)]
Stop = Annotated[tuple[StopString, ...], Field(max_length=MAX_STOP_STRINGS),
                 BeforeValidator(_listed, json_schema_input_type=StopString | Annotated[
                     list[StopString], Field(max_length=MAX_STOP_STRINGS)])]
Flag = Annotated[bool, Strict()]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy."""

    max_tokens: MaxTokens = 256
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    stop: Stop = ()
    seed: Seed | None = None
    ignore_eos: Flag = False

    @classmethod
    def from_map(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Validate and build from an untrusted map (msgpack); a null value means the default."""
        return validated(_SAMPLING, data, "params")

    def to_map(self) -> dict[str, Any]:
        return {**asdict(self), "stop": list(self.stop)}


@with_config(ConfigDict(extra="ignore"))
@dataclass(frozen=True, slots=True)
class CoalesceParams:
    """Token coalescing windows; ``None`` means "use the worker's default", 0 = every token."""

    max_tokens: Annotated[int, Whole(0, 4096)] | None = None
    max_delay_ms: Annotated[float, Field(strict=True, ge=0, le=10_000, allow_inf_nan=False)] | None = None

    @classmethod
    def from_map(cls, data: Mapping[str, Any] | None) -> CoalesceParams:
        return validated(_COALESCE, data, "coalesce", nested=True)

    def to_map(self) -> dict[str, Any]:
        return asdict(self)


_SAMPLING = TypeAdapter(SamplingParams)
_COALESCE = TypeAdapter(CoalesceParams)


def validated(adapter: TypeAdapter[T], data: Mapping[str, Any] | None, name: str, *, nested: bool = False,
              within: str | None = None) -> T:
    """``data`` (an untrusted map, nulls meaning defaults) as ``adapter``'s type, or an
    :class:`InvalidRequest` naming the first offending field (inside ``name`` if ``nested``; a
    field inside the map's ``within`` by its own name)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InvalidRequest(f"'{name}' must be an object", param=name)
    try:
        return adapter.validate_python({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        errors = exc.errors()
        if nested:
            errors = [{**e, "loc": (name, *e["loc"])} for e in errors]
        if within is not None:
            errors = [{**e, "loc": e["loc"][1:]} if e["loc"][:1] == (within,) and len(e["loc"]) > 1 else e
                      for e in errors]
        raise invalid_request(errors) from exc


def invalid_request(errors: Sequence[Any], skip: int = 0) -> InvalidRequest:
    """The first of pydantic's (or FastAPI's) validation errors as a 400 that names the field:
    ``param`` is the top-level field, the message gives the whole path. ``skip`` drops leading
    location parts (FastAPI's ``body``, ``query``, ``header``)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ())][skip:]
    path = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequest(f"'{path}': {message}" if path else message, param=loc[0] if loc else None)
