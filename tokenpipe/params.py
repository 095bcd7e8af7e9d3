"""Request parameters: sampling and token coalescing, validated from untrusted maps.

Part of the wire contract: :mod:`tokenpipe.wire` carries them inside a :class:`Request` and
re-exports them (import them from there). They have their own module because validating
untrusted values is most of their code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import InvalidRequest

__all__ = ["SamplingParams", "CoalesceParams", "MAX_STOP_STRINGS", "MAX_STOP_LEN", "MAX_TOKENS_LIMIT"]

# Bounds that keep a single request from monopolising a worker; the relay may be stricter.
MAX_STOP_STRINGS = 8
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1 << 20


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
