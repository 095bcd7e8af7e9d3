"""Each tenant's streams, newest first: an index in the meta bucket, readable without scanning.

The meta bucket's ``<id>`` entry says who owns a stream (:class:`~tokenpipe.wire.StreamMeta`); it
cannot be listed by tenant without reading every entry of every tenant. So :func:`record` also
writes ``ix.<tenant>.<created ns>.<model>.<id>`` (``<tenant>``: a hash of the tenant's name, which
may hold characters a key may not), whose value is the request as submitted
(:class:`~tokenpipe.wire.IndexedRequest`: what an inspector shows as the stream's parameters).

Listing one tenant's streams (:func:`list_entries`) is one ``STREAM.INFO`` with a subjects filter:
the server answers from its subject index with the *names* of that tenant's keys only — no other
tenant's entry and no value is read — and the name carries what ordering and the model filter
need. Values and token history are read for one page only (by the caller). The entries expire
with the bucket's TTL; the work of a listing grows with the tenant's own streams within it (names
only), never with anyone else's.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError

from .bus import Bus
from .errors import TransportError, WireFormatError
from .retry import through_elections
from .subjects import META_BUCKET, META_STREAM, check_model_name, check_stream_id
from .wire import IndexedRequest, Request, StreamMeta

__all__ = ["IndexEntry", "index_key", "list_entries", "read_request", "rebuild_meta", "record",
           "stream_ids", "tenant_token"]

log = logging.getLogger(__name__)

_PREFIX = "ix"
_CREATED_DIGITS = 20  # zero-padded ns: names sort as times do


def tenant_token(tenant: str) -> str:
    """A key-safe, fixed-length name for ``tenant`` (128 bits of its SHA-256)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


def index_key(tenant: str, created_at: int, model: str, stream_id: str) -> str:
    return (f"{_PREFIX}.{tenant_token(tenant)}.{created_at:0{_CREATED_DIGITS}d}."
            f"{check_model_name(model)}.{check_stream_id(stream_id)}")


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One stream of a tenant, as its index key names it."""

    id: str
    model: str
    created_at: int


def _parse(subject: str) -> IndexEntry | None:
    # $KV.<bucket>.ix.<tenant>.<created>.<model>.<id>
    parts = subject.split(".")
    if len(parts) != 7 or not parts[4].isdigit():
        return None
    return IndexEntry(id=parts[6], model=parts[5], created_at=int(parts[4]))


async def _subjects(bus: Bus, subjects_filter: str, failed: str) -> dict[str, int]:
    """The meta bucket's subjects matching ``subjects_filter`` (names and counts: no value is read)."""
    try:
        info = await through_elections(lambda: bus.registry_js.stream_info(META_STREAM,
                                                                          subjects_filter=subjects_filter))
    except Exception as exc:
        raise TransportError(f"{failed}: {exc}") from exc
    return info.state.subjects or {}


async def record(bus: Bus, request: Request, traceparent: str = "") -> None:
    """Add a relay stream to its tenant's index. A failure is logged, not raised: the stream
    itself is served all the same; only listings miss it."""
    key = index_key(request.tenant, request.created_at, request.model, request.id)
    value = IndexedRequest(request, traceparent).encode()
    try:
        await through_elections(lambda: bus.meta.put(key, value))
    except Exception as exc:  # nats.js.errors.*, timeouts: one translation point, and not fatal
        log.warning("could not index the stream for listings", extra={"request_id": request.id, "error": repr(exc)})


async def list_entries(bus: Bus, tenant: str) -> list[IndexEntry]:
    """The tenant's indexed streams, newest first (names only: no value is read)."""
    subjects = await _subjects(bus, f"$KV.{META_BUCKET}.{_PREFIX}.{tenant_token(tenant)}.>", "could not list streams")
    entries = (e for e in map(_parse, subjects) if e is not None)
    return sorted(entries, key=lambda e: (e.created_at, e.id), reverse=True)


async def stream_ids(bus: Bus) -> list[str]:
    """Every stream id the meta bucket holds an entry for (one deleted lately included: its
    marker is the subject's last message until it ages out), for a listing of all tenants.

    One ``STREAM.INFO`` filtered to ``$KV.<bucket>.*`` (ids hold no dots, so no index entry),
    answered from the server's subject index under its store lock. Not ``KeyValue.keys()``: its
    watcher decides it has seen every key from per-message pending counts and a delivery counter
    that can both say "done" early (nats.py #842, #995); on a loaded machine it answered
    "no keys" for a bucket of 30 (1 listing in 40 here) and ``tokenpipe streams`` left out the
    stream just made. One answer names at most 100,000 subjects (the server's page)."""
    subjects = await _subjects(bus, f"$KV.{META_BUCKET}.*", "could not list streams")
    return [subject.rsplit(".", 1)[1] for subject in subjects]


async def read_request(bus: Bus, meta: StreamMeta) -> IndexedRequest | None:
    """The request a stream was submitted with, or None when it was never indexed (an older relay,
    a failed index write) or has expired."""
    try:
        entry = await through_elections(lambda: bus.meta.get(index_key(meta.tenant, meta.created_at, meta.model,
                                                                          meta.id)))
    except KeyNotFoundError:
        return None
    except Exception as exc:
        raise TransportError(f"could not read the stream's request: {exc}") from exc
    if not entry.value:
        return None
    try:
        return IndexedRequest.decode(entry.value)
    except WireFormatError as exc:
        log.warning("unreadable index entry", extra={"request_id": meta.id, "error": exc.message})
        return None


async def rebuild_meta(bus: Bus, stream_id: str, tenant: str) -> StreamMeta | None:
    """``tenant``'s ownership record of ``stream_id``, rebuilt from its index entry (written with it
    by the relay, holding the request as submitted) and stored again; None when ``tenant`` has no
    such entry (someone else's stream, or none). For an entry that no longer decodes: junk stored
    over it must not lock its owner out of the stream."""
    check_stream_id(stream_id)
    subjects = await _subjects(bus, f"$KV.{META_BUCKET}.{_PREFIX}.{tenant_token(tenant)}.*.*.{stream_id}",
                               "could not read the stream index")
    entry = next((e for e in map(_parse, subjects) if e is not None and e.id == stream_id), None)
    if entry is None:
        return None
    meta = StreamMeta(stream_id, tenant, entry.model, entry.created_at)
    indexed = await read_request(bus, meta)
    if indexed is None or indexed.request.id != stream_id or indexed.request.tenant != tenant:
        return None  # the index entry itself is gone or junk: nothing trustworthy to rebuild from
    try:
        await through_elections(lambda: bus.meta.put(stream_id, meta.encode()))
    except Exception as exc:  # served all the same; the next read rebuilds it again
        log.warning("could not store the rebuilt stream record", extra={"request_id": stream_id, "error": repr(exc)})
    log.warning("stream record did not decode; rebuilt from the stream index", extra={"request_id": stream_id})
    return meta
