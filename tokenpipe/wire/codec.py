"""The wire's framing: msgpack and JSON maps with a version field, and the ids and clocks every
shape stamps. Pure functions over bytes."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgpack

from ..errors import WireFormatError

__all__ = ["WIRE_VERSION", "dump_json", "load_json", "new_request_id", "now_ns", "pack", "unpack", "unpack_any"]

WIRE_VERSION = 1
_MSGPACK_ERRORS = (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


def new_request_id() -> str:
    """About 128 random bits, URL- and subject-safe (no dots, no wildcards).

    Never starting with ``-``: such an id read as an option on a command line
    (``tokenpipe replay -x…``); redrawing those 1 in 64 costs under 0.03 bits."""
    while (rid := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return rid


def now_ns() -> int:
    return time.time_ns()


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_any(data: bytes) -> Any:
    """Whatever msgpack value ``data`` holds, or None when it is not msgpack."""
    try:
        return msgpack.unpackb(data, raw=False)
    except _MSGPACK_ERRORS:
        return None


def unpack(data: bytes, what: str) -> dict[str, Any]:
    """A versioned msgpack map; :class:`WireFormatError` naming ``what`` otherwise."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except _MSGPACK_ERRORS as exc:
        raise WireFormatError(f"{what}: not valid msgpack ({exc})") from exc
    return _versioned(obj, what, "msgpack map", "missing integer version field 'v'", None)


def _versioned(obj: Any, what: str, kind: str, bad_version: str, absent: int | None) -> dict[str, Any]:
    """``obj`` if it is a map whose version field (``absent`` when missing) this side can read."""
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what}: expected a {kind}, got {type(obj).__name__}")
    version = obj.get("v", absent)
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireFormatError(f"{what}: {bad_version}")
    if version > WIRE_VERSION:
        raise WireFormatError(f"{what}: wire version {version} is newer than supported {WIRE_VERSION}")
    return obj


def dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def load_json(data: bytes, what: str) -> dict[str, Any]:
    """A JSON object whose version field, if any (older peers wrote none), this side can read."""
    try:
        obj = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise WireFormatError(f"{what}: not valid JSON ({exc})") from exc
    return _versioned(obj, what, "JSON object", "version field 'v' must be an integer", 1)
