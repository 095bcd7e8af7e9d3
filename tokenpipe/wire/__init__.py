"""The wire contract: every shape that crosses a process boundary, encoded and versioned.

Requests and token batches are msgpack maps (:mod:`.request`, :mod:`.batch`), the control-plane
shapes JSON maps (:mod:`.control`, which says why). Each shape is declared once, and the
declaration is its encoder, decoder and validation (msgspec Structs; the request, whose bounds
the relay's HTTP bodies share, a dataclass validated by pydantic). Every map has a ``v`` field;
decoders ignore unknown keys so newer peers can add fields, and ``v`` bumps only on an
incompatible change. These are pure functions over bytes: no transport is imported here. Import
the NATS shapes from this package; the relay's WebSocket frames are in :mod:`.frames`.
"""

from ..params import CoalesceParams, SamplingParams
from .batch import FINISH_REASONS, FinishReason, TokenBatch, Usage
from .codec import WIRE_VERSION, new_request_id, now_ns
from .control import Announcement, Cancel, Held, IndexedRequest, PlacementSummary, StreamMeta
from .request import (
    DEFAULT_TIER,
    SERVICE_TIERS,
    Message,
    Request,
    Role,
    ServedTier,
    ServiceTier,
    TokenId,
    chat_message,
    peek_request_id,
)

__all__ = [
    "WIRE_VERSION",
    "FINISH_REASONS",
    "FinishReason",
    "SamplingParams",
    "CoalesceParams",
    "Request",
    "Role",
    "ServiceTier",
    "ServedTier",
    "SERVICE_TIERS",
    "DEFAULT_TIER",
    "Message",
    "chat_message",
    "TokenId",
    "TokenBatch",
    "Cancel",
    "Held",
    "Usage",
    "StreamMeta",
    "IndexedRequest",
    "Announcement",
    "PlacementSummary",
    "new_request_id",
    "now_ns",
    "peek_request_id",
]
