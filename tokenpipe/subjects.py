"""Subject and stream names: the one place that spells them.

Every subject that carries a stream names its *owner*: the publisher on the bus that created
the stream (``relay`` for every stream made through the HTTP API, an app's name for the
producer SDK). NATS permissions are subject-based, so putting the owner in the subject is
what lets an app's credentials reach only its own streams (:mod:`tokenpipe.natsauth`):

- ``tp.req.<model>.<owner>``: a request; a generator takes the owner from the subject,
  never from the payload. ``tp.req.<model>.<owner>.p<k>``: one *placed* on the generator that holds
  placement slot ``k`` (where its prefix is cached, tokenpipe.placement), taken from that slot's
  consumer (:func:`slot_consumer_name`). An application's requests are stored first in a stream of its own
  (:func:`intake_stream`), which ``TP_REQUESTS`` sources: a publisher's JetStream headers are
  evaluated against that stream alone (tokenpipe.bus);
- ``tp.tok.<owner>.<id>``: a stream's token batches, as stored (``TP_TOKENS``; each append is
  conditional on the stream's last stored batch, :mod:`tokenpipe.append`);
- ``tp.live.<owner>.<id>``: the same batches for live readers, sent only once stored (an app's
  account imports them as its own ``tp.tok.<app>.>``, tokenpipe.natsconfig);
- ``tp.cancel.<owner>.<id>``: its cancellation.
"""

from __future__ import annotations

import re

from .errors import InvalidRequest

__all__ = [
    "REQUESTS_STREAM",
    "intake_stream",
    "owner_of_intake",
    "owner_request_subjects",
    "TOKENS_STREAM",
    "META_BUCKET",
    "META_STREAM",
    "ALIVE_PREFIX",
    "FILES_BUCKET",
    "FILES_STREAM",
    "BATCHES_BUCKET",
    "BATCHES_STREAM",
    "ANNOUNCE_PREFIX",
    "DISCOVER_SUBJECT",
    "HELD_PREFIX",
    "RELAY_OWNER",
    "RELAY_API",
    "RELAY_COPY_PREFIX",
    "TOKENPIPE_API",
    "request_subject",
    "model_request_filter",
    "owner_of_request",
    "token_subject",
    "live_subject",
    "LIVE_WILDCARD",
    "owner_tokens",
    "cancel_subject",
    "parse_cancel_subject",
    "stream_key",
    "consumer_name",
    "slot_consumer_name",
    "slot_filter",
    "shared_request_filter",
    "slot_of_request",
    "PLACE_PREFIX",
    "check_model_name",
    "check_owner",
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
META_STREAM = f"KV_{META_BUCKET}"  # the stream JetStream keeps a KV bucket in
FILES_BUCKET = "tp_files"  # the Batch API's files (an object store)
FILES_STREAM = f"OBJ_{FILES_BUCKET}"
BATCHES_BUCKET = "tp_batches"  # the Batch API's file records and batch states (a KV bucket)
BATCHES_STREAM = f"KV_{BATCHES_BUCKET}"

REQUEST_WILDCARD = "tp.req.>"
_INTAKE_PREFIX = "TP_REQ_"
TOKEN_WILDCARD = "tp.tok.>"
LIVE_WILDCARD = "tp.live.>"
CANCEL_WILDCARD = "tp.cancel.>"
# "Does anyone hold a live reader of this stream?" — a core request every relay holding one
# answers; a relay asks before a disconnect cancels a generation (viewers are not owners).
READERS_WILDCARD = "tp.readers.*"
ANNOUNCE_PREFIX = "tp.gen.announce"
DISCOVER_SUBJECT = "tp.gen.discover"
# What each generator's prefix cache holds and how loaded it is: tp.gen.place.<model>.<worker>, heard by
# whoever submits requests (relays, applications' SDKs), for placement (tokenpipe.placement).
PLACE_PREFIX = "tp.gen.place"
# Which requests (their JetStream ack subjects) each generator holds: tp.gen.held.<model>.<worker>,
# heard by the generators of the model alone (generator.service.rescue).
HELD_PREFIX = "tp.gen.held"
# tp.gen.alive.<worker>: subscribed by that generator and never answered. A request there times out
# while the worker is connected and gets "no responders" from the server once its connection is gone.
ALIVE_PREFIX = "tp.gen.alive"

# The owner of every stream made through a relay: tenants are mapped only in the relay.
RELAY_OWNER = "relay"
# The relay's questions to the admin about its own subjects (tokenpipe.storeinfo): leader-side counts
# and the shared streams' configuration, which it may not ask JetStream itself.
STORE_PREFIX = "tp.store"
# The relay's own NATS account (tokenpipe.relayaccount): tokenpipe's JetStream API as the relay's
# account imports a few of its calls, the relay account's API as tokenpipe's account (the admin)
# imports it, and where tokenpipe's account delivers the relay's batches for the relay's copy of them.
TOKENPIPE_API = "$JS.TP.API"
RELAY_API = "$JS.RELAY.API"
RELAY_COPY_PREFIX = "tp.relaycopy"

# Subject tokens may not contain '.', '*', '>' or whitespace; keep names boring.
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _checked(name: str, message: str, param: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(message, param=param)
    return name


def check_model_name(model: str) -> str:
    return _checked(model, "model names use 1-64 of A-Z a-z 0-9 _ - (no dots or spaces)", "model")


def check_stream_id(stream_id: str) -> str:
    return _checked(stream_id, "malformed stream id", "id")


def check_owner(owner: str) -> str:
    return _checked(owner, "owner (app) names use 1-64 of A-Z a-z 0-9 _ -", "owner")


def request_subject(model: str, owner: str, slot: int | None = None) -> str:
    """Where ``owner`` publishes a request for ``model``: the shared queue, or placed on ``slot``."""
    base = f"tp.req.{check_model_name(model)}.{check_owner(owner)}"
    return base if slot is None else f"{base}.p{int(slot)}"


def model_request_filter(model: str) -> str:
    """Every owner's requests for ``model``, placed or not (``TP_REQUESTS``' subjects on an open bus)."""
    return f"tp.req.{check_model_name(model)}.>"


def shared_request_filter(model: str) -> str:
    """The requests for ``model`` placed on no generator: the filter of the shared consumer."""
    return f"tp.req.{check_model_name(model)}.*"


def slot_filter(model: str, slot: int) -> str:
    """The requests for ``model`` placed on slot ``slot``, every owner's."""
    return f"tp.req.{check_model_name(model)}.*.p{int(slot)}"


def owner_request_subjects(owner: str, models: list[str]) -> list[str]:
    """``owner``'s request subjects for ``models`` (none: for any model), placed or not."""
    o = check_owner(owner)
    bases = [request_subject(m, o) for m in models] or [f"tp.req.*.{o}"]
    return [s for b in bases for s in (b, f"{b}.*")]


def intake_stream(app: str) -> str:
    """The stream an application's requests are stored in first (``TP_REQ_<app>``, in tokenpipe's
    account), which ``TP_REQUESTS`` sources."""
    return _INTAKE_PREFIX + check_owner(app)


def owner_of_intake(stream: str) -> str | None:
    """The application whose intake stream ``stream`` is; None for any other stream."""
    if not stream.startswith(_INTAKE_PREFIX):
        return None
    try:
        return check_owner(stream[len(_INTAKE_PREFIX):])
    except InvalidRequest:
        return None


def owner_of_request(subject: str) -> str:
    """The owner a request was published by, from its subject ``tp.req.<model>.<owner>[.p<k>]``."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[:2] != ["tp", "req"] or (len(parts) == 5 and _slot(parts[4]) is None):
        raise InvalidRequest(f"not a request subject: {subject!r}")
    return check_owner(parts[3])


def slot_of_request(subject: str) -> int | None:
    """The placement slot a request subject names, or None (the shared queue)."""
    parts = subject.split(".")
    return _slot(parts[4]) if len(parts) == 5 else None


def _slot(token: str) -> int | None:
    return int(token[1:]) if token.startswith("p") and token[1:].isdigit() and len(token) <= 5 else None


def token_subject(owner: str, stream_id: str) -> str:
    return f"tp.tok.{check_owner(owner)}.{check_stream_id(stream_id)}"


def owner_tokens(owner: str) -> str:
    """Every token subject of ``owner``'s streams (an app's own copy of them, tokenpipe.natsconfig)."""
    return f"tp.tok.{check_owner(owner)}.>"


def live_subject(owner: str, stream_id: str) -> str:
    """Where a stream's batches go live, each once the store accepted it (never a refused one)."""
    return f"tp.live.{check_owner(owner)}.{check_stream_id(stream_id)}"


def cancel_subject(owner: str, stream_id: str) -> str:
    return f"tp.cancel.{check_owner(owner)}.{check_stream_id(stream_id)}"


def parse_cancel_subject(subject: str) -> tuple[str, str]:
    """``(owner, stream id)`` of ``tp.cancel.<owner>.<id>``."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != ["tp", "cancel"]:
        raise InvalidRequest(f"not a cancel subject: {subject!r}")
    return check_owner(parts[2]), check_stream_id(parts[3])


def stream_key(owner: str, stream_id: str) -> str:
    """What a generator keys a running stream by: its owner and its id (two owners may choose the
    same id, and neither may displace, refuse or cancel the other's). ``<owner>.<id>``, the tail of
    its token subject: neither part may hold a dot."""
    return f"{check_owner(owner)}.{check_stream_id(stream_id)}"


def readers_subject(stream_id: str) -> str:
    return f"tp.readers.{check_stream_id(stream_id)}"


def consumer_name(model: str) -> str:
    """The durable pull consumer shared by every generator serving ``model``."""
    return f"gen-{check_model_name(model)}"


def slot_consumer_name(model: str, slot: int) -> str:
    """The durable pull consumer of the requests placed on slot ``slot`` of ``model``: its holder pulls
    first, every other generator of the model at a lower priority (``place-<model>-<k>``: the last
    dash-separated part is the slot, so no two models' names collide)."""
    return f"place-{check_model_name(model)}-{int(slot)}"
