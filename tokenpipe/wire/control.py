"""The control plane's shapes, JSON so operators read them with ``nats sub`` and ``nats kv get``:
a stream's owner (:class:`StreamMeta`), its index entry (:class:`IndexedRequest`), a
:class:`Cancel`, a generator's :class:`Announcement` and the requests it holds (:class:`Held`).
Each is declared once: a msgspec Struct (its version the tag ``v``, absent in entries written
before the field existed), except the index entry, which carries a :class:`~.request.Request` and
is validated as one is."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated, ClassVar, Literal, Self

import msgspec
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from ..errors import InvalidRequest, WireFormatError
from ..params import invalid_request
from .codec import WIRE_VERSION, decoded, to_json
from .request import Request, _present

__all__ = ["Announcement", "Cancel", "Held", "IndexedRequest", "PlacementSummary", "StreamMeta"]


class _Control(msgspec.Struct, frozen=True, tag_field="v", tag=WIRE_VERSION):
    """A control shape: its JSON map is its fields; unknown keys are ignored, absent ones are
    their defaults. ``_what`` names it in errors."""

    _what: ClassVar[str] = "control message"

    def encode(self) -> bytes:
        return to_json(self)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return decoded(partial(msgspec.json.decode, type=cls), data, cls._what, "JSON")


class StreamMeta(_Control, frozen=True):
    """Who owns a stream: its entry in the meta bucket, keyed by stream id (JSON)."""

    _what: ClassVar[str] = "stream meta"
    id: str
    tenant: str
    model: str
    created_at: int


class Cancel(_Control, frozen=True):
    """Stop generating stream ``id``: published by its ``owner`` on ``tp.cancel.<owner>.<id>``
    (JSON). A generator acts only on one that names the subject's owner and stream; anything else
    there (a server's answer provoked onto the subject with a forged reply subject, junk, an empty
    message) is dropped and counted."""

    _what: ClassVar[str] = "cancel"
    id: str
    owner: str
    type: Literal["cancel"] = "cancel"


class Announcement(_Control, frozen=True):
    """A generator saying it serves ``model`` (``ready``) or is leaving, and how loaded it is.

    Published on ``tp.gen.announce.<worker>`` every few seconds and in answer to
    ``tp.gen.discover`` (JSON); a relay forgets it ``ttl_s`` seconds after the last one.
    """

    _what: ClassVar[str] = "announcement"
    worker: str
    model: str
    ready: bool = True
    max_batch: int = 0
    running: int = 0
    active: int = 0
    pid: int = 0
    streams: tuple[str, ...] = ()  # the relay's streams it holds (HTTP ids; no app's): for operators and tests
    device: str = ""
    ttl_s: float = 6.0
    ts: float = 0.0  # wall-clock seconds when sent
    free_blocks: int = 0  # KV-cache blocks a new sequence could get now (free or cached, unheld)
    block_size: int = 0  # positions per KV block


class Held(_Control, frozen=True):
    """The requests a generator holds: the JetStream ack subjects of their deliveries, published on
    ``tp.gen.held.<model>.<worker>`` when the set changes and every progress interval (JSON). The
    model's other generators keep the latest; once the server says the worker's connection is gone,
    one of them hands these deliveries back (NAK) so that they move on before ``ack_wait``."""

    _what: ClassVar[str] = "held requests"
    worker: str
    model: str
    acks: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()  # the workers it has heard: who may hand a dead one's requests back
    leaving: bool = False  # a worker stopping: its requests are handed back by itself


class PlacementSummary(_Control, frozen=True):
    """What a generator's prefix cache holds and how loaded it is, for placement
    (:mod:`tokenpipe.placement`): published on ``tp.gen.place.<model>.<worker>`` when it changes (at
    most every 100 ms) and every announce interval (JSON). ``keys`` are hashed prompt prefixes (never
    text), at most :data:`tokenpipe.placement.MAX_KEYS`; ``slot`` the placement slot it pulls first
    (-1: none). Forgotten ``ttl_s`` after the last one, or at once when ``ready`` is False."""

    _what: ClassVar[str] = "placement summary"
    worker: str
    model: str
    slot: int = -1
    keys: tuple[str, ...] = ()
    running: int = 0
    waiting: int = 0
    max_batch: int = 0
    ready: bool = True
    ttl_s: float = 6.0


@dataclass(frozen=True, slots=True)
class IndexedRequest:
    """A relay stream's entry in its tenant's index (meta bucket, :mod:`tokenpipe.streamindex`): the
    request as submitted and the W3C ``traceparent`` of the span that submitted it (JSON)."""

    request: Annotated[Request, BeforeValidator(_present)]
    traceparent: str = ""
    v: Annotated[int, Field(strict=True, le=WIRE_VERSION)] = WIRE_VERSION  # absent in entries written before it

    def encode(self) -> bytes:
        # the request's own map (its default tier left out, as in its msgpack), in field order
        return to_json({"request": self.request.to_map(), "traceparent": self.traceparent, "v": self.v})

    @classmethod
    def decode(cls, data: bytes) -> IndexedRequest:
        obj = decoded(_JSON_MAP.decode, data, "indexed request", "JSON")
        try:
            return _INDEXED.validate_python(obj)
        except ValidationError as exc:
            raise WireFormatError(f"indexed request: {invalid_request(exc.errors()).message}") from exc
        except InvalidRequest as exc:
            raise WireFormatError(f"indexed request: {exc.message}") from exc


_JSON_MAP = msgspec.json.Decoder(dict[str, object])
_INDEXED = TypeAdapter(IndexedRequest)
