"""Subject and stream names: the one place that spells them."""

from __future__ import annotations

import re

from .errors import InvalidRequest

__all__ = [
    "REQUESTS_STREAM",
    "TOKENS_STREAM",
    "META_BUCKET",
    "ANNOUNCE_PREFIX",
    "DISCOVER_SUBJECT",
    "request_subject",
    "token_subject",
    "cancel_subject",
    "consumer_name",
    "check_model_name",
    "check_stream_id",
    "REQUEST_WILDCARD",
    "TOKEN_WILDCARD",
    "CANCEL_WILDCARD",
    "readers_subject",
    "READERS_WILDCARD",
]

REQUESTS_STREAM = "TP_REQUESTS"
TOKENS_STREAM = "TP_TOKENS"
META_BUCKET = "tp_streams"

REQUEST_WILDCARD = "tp.req.>"
TOKEN_WILDCARD = "tp.tok.>"
CANCEL_WILDCARD = "tp.cancel.>"
# "Does anyone hold a live reader of this stream?" — a core request every relay holding one
# answers; a relay asks before a disconnect cancels a generation (viewers are not owners).
READERS_WILDCARD = "tp.readers.*"
ANNOUNCE_PREFIX = "tp.gen.announce"
DISCOVER_SUBJECT = "tp.gen.discover"

# Subject tokens may not contain '.', '*', '>' or whitespace; keep names boring.
_MODEL_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_model_name(model: str) -> str:
    if not isinstance(model, str) or not _MODEL_RE.fullmatch(model):
        raise InvalidRequest(
            "model names use 1-64 of A-Z a-z 0-9 _ - (no dots or spaces)", param="model"
        )
    return model


def check_stream_id(stream_id: str) -> str:
    if not isinstance(stream_id, str) or not _ID_RE.fullmatch(stream_id):
        raise InvalidRequest("malformed stream id", param="id")
    return stream_id


def request_subject(model: str) -> str:
    return f"tp.req.{check_model_name(model)}"


def token_subject(stream_id: str) -> str:
    return f"tp.tok.{check_stream_id(stream_id)}"


def cancel_subject(stream_id: str) -> str:
    return f"tp.cancel.{check_stream_id(stream_id)}"


def readers_subject(stream_id: str) -> str:
    return f"tp.readers.{check_stream_id(stream_id)}"


def consumer_name(model: str) -> str:
    """The durable pull consumer shared by every generator serving ``model``."""
    return f"gen-{check_model_name(model)}"
