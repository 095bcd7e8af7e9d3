"""The wire's framing: msgspec encoders and decoders, the error every undecodable message becomes,
and the ids and clocks every shape stamps. Pure functions over bytes."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from ..errors import WireFormatError

__all__ = ["WIRE_VERSION", "decoded", "new_request_id", "now_ns", "pack", "to_json", "unpack", "unpack_any"]

WIRE_VERSION = 1
T = TypeVar("T")

# Encoders keep no state between calls; one each saves building it per message.
pack = msgspec.msgpack.Encoder().encode
to_json = msgspec.json.Encoder().encode
_ANY = msgspec.msgpack.Decoder()


def new_request_id() -> str:
    """About 128 random bits, URL- and subject-safe (no dots, no wildcards).

    Never starting with ``-``: such an id read as an option on a command line
    (``tokenpipe replay -x…``); redrawing those 1 in 64 costs under 0.03 bits."""
    while (rid := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return rid


def now_ns() -> int:
    return time.time_ns()


def decoded(decode: Callable[[bytes], T], data: bytes, what: str, kind: str = "msgpack") -> T:
    """``data`` decoded (and validated) by msgspec's ``decode`` (of ``kind``: msgpack or JSON), or a
    :class:`WireFormatError` naming ``what``.

    A shape's version is its msgspec tag ``v``: absent means this version (maps written before it
    existed), any other value is a version this side cannot read."""
    try:
        return decode(data)
    except msgspec.ValidationError as exc:
        if str(exc).endswith("at `$.v`"):
            raise WireFormatError(f"{what}: wire version is not {WIRE_VERSION}, the one supported ({exc})") from exc
        raise WireFormatError(f"{what}: bad field ({exc})") from exc
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"{what}: not valid {kind} ({exc})") from exc


def unpack_any(data: bytes) -> Any:
    """Whatever msgpack value ``data`` holds, or None when it is not msgpack."""
    try:
        return _ANY.decode(data)
    except msgspec.DecodeError:
        return None


def unpack(data: bytes, what: str) -> dict[str, Any]:
    """A versioned msgpack map, for a shape validated from a map (:class:`~.request.Request`);
    :class:`WireFormatError` naming ``what`` otherwise."""
    try:
        obj = _ANY.decode(data)
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"{what}: not valid msgpack ({exc})") from exc
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireFormatError(f"{what}: missing integer version field 'v'")
    if version > WIRE_VERSION:
        raise WireFormatError(f"{what}: wire version {version} is newer than supported {WIRE_VERSION}")
    return obj
