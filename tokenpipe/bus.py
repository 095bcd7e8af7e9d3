"""NATS connection and idempotent JetStream provisioning."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from . import natsauth
from .batchstore import BATCH_STREAMS
from .cluster import connected_server, resolve_replicas, server_list
from .errors import InvalidRequest, TransportError
from .placement import Choice, PlacementTable, follow_summaries
from .relayaccount import provision_relay_account, relay_account_api, relay_account_missing
from .retry import Retry, retrying, transient
from .settings import Settings
from .slots import ensure_slot_consumers, slots_drift
from .storeinfo import ask_config
from .streamsetup import SEALED_ACTION, ensure_registry, ensure_stream, same_setting, source_names, tokens_config
from .subjects import (
    META_BUCKET,
    META_STREAM,
    RELAY_OWNER,
    REQUEST_WILDCARD,
    REQUESTS_STREAM,
    TOKEN_WILDCARD,
    TOKENPIPE_API,
    TOKENS_STREAM,
    check_model_name,
    consumer_name,
    intake_stream,
    model_request_filter,
    owner_of_intake,
    owner_of_request,
    owner_request_subjects,
    owner_tokens,
    shared_request_filter,
)

__all__ = ["Bus", "connect", "consumer_drift", "intake_config", "intake_owners", "missing", "patiently", "provision",
           "provision_copy", "release_intake", "repair", "request_consumer_config", "requests_config", "served_models",
           "REPAIR_INTERVAL_S"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_RELEASE_TIMEOUT_S = 2.0  # release_intake's wait for its delete
_ASK_TIMEOUT_S = 5.0  # missing()'s question to the admin about a shared stream (tokenpipe.storeinfo)
_PROVISIONING = Retry(budget_s=60.0, first_delay_s=0.25, max_delay_s=2.0)  # connect()'s, while JetStream times out
REPAIR_INTERVAL_S = 2.0  # how often the relay and the generators check that what tokenpipe provisions exists


@dataclass
class Bus:
    """An open NATS connection with its JetStream context and the stream-metadata bucket."""

    nc: NATS
    js: JetStreamContext
    meta: KeyValue
    # Called after a reconnect (with None: any subscription may have missed messages) or a
    # slow-consumer error (with the subscription that dropped messages).
    on_possible_loss: list[Callable[[Any], None]] = field(default_factory=list)
    # Called with the reason whenever a reader drops a token message that is no batch of the stream
    # it was read for (tokenpipe.streams.batch_of): the relay counts them in a metric.
    on_dropped_batch: list[Callable[[str], None]] = field(default_factory=list)
    closing: bool = False
    # Whose streams this connection makes and reads (the owner in their subjects, tokenpipe.subjects).
    owner: str = RELAY_OWNER
    # Whether this connection may touch the tp_streams registry (re-provisioning passes it on).
    registry: bool = True
    # The replica count TOKENPIPE_REPLICAS resolved to against the connected cluster.
    replicas: int = 1
    # Whether this connection may create and configure tokenpipe's streams (tokenpipe.natsauth:
    # the admin, or anyone on an open bus); the others only report what is missing or drifted.
    provisions: bool = True
    # Whether its leader-side counts and the shared streams' configuration come from the admin's
    # answers (tokenpipe.storeinfo) instead of STREAM.INFO, which it may not call: the relay under NATS
    # authorization (STREAM.INFO's subjects filter, in the body, listed every owner's ids).
    store_questions: bool = False
    secret: bytes = b""  # this identity's own secret (natsauth.Identity.secret)
    # The generators' placement summaries, where this connection submits requests (the relay, an
    # app's SDK) and placement is on (tokenpipe.placement); None: every request to the shared queue.
    placement: PlacementTable | None = None
    # Called with each request's placement (None: the shared queue): the relay counts them in a metric.
    on_placed: list[Callable[[Choice | None], None]] = field(default_factory=list)
    # The relay's own account (tokenpipe.relayaccount), as the admin reaches its JetStream; None: there
    # is none (an open bus), and the registry is in this connection's account.
    relay_js: JetStreamContext | None = None
    # The relay in its own account: tokenpipe's TP_REQUESTS consumers through the one call its account
    # imports (``$JS.TP.API``); its TP_TOKENS is a copy (tokenpipe.relayaccount). None: ``js`` asks them.
    queue_js: JetStreamContext | None = None

    @property
    def registry_js(self) -> JetStreamContext:
        """The JetStream of the account that holds the ``tp_streams`` registry."""
        return self.relay_js or self.js

    @property
    def requests_js(self) -> JetStreamContext:
        """The JetStream that answers about ``TP_REQUESTS``' consumers."""
        return self.queue_js or self.js

    @property
    def relay_copy(self) -> bool:
        """Whether this is the relay in its own account, whose ``TP_TOKENS`` is a copy of its batches."""
        return self.queue_js is not None

    def msg_id(self, request_id: str) -> str:
        """The ``Nats-Msg-Id`` of ``request_id``'s request: the same on every retry, and not one
        another tenant can compute (an id it published first would swallow this one as a duplicate)."""
        if not self.secret:
            return f"{self.owner}:{request_id}"
        tag = hmac.new(hashlib.sha256(self.secret).digest(), request_id.encode(), hashlib.sha256).hexdigest()[:16]
        return f"{self.owner}:{request_id}:{tag}"

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        self.closing = True  # the disconnect that follows is ours, not news
        try:
            await self.nc.drain()
        except nats.errors.ConnectionReconnectingError:
            await self.nc.close()  # the server is gone: nothing can be drained to it


async def connect(settings: Settings, *, name: str, provision_streams: bool = True, role: str = "relay",
                  apps: list[str] | None = None) -> Bus:
    """Connect as ``role`` (its credentials, TLS and inbox: :mod:`tokenpipe.natsauth`; retrying
    forever on disconnect), provision streams (``apps``: the admin's applications, :func:`provision`),
    open the meta bucket."""
    ident = natsauth.identity(settings, role)

    bus: Bus | None = None

    async def _err(exc: Exception) -> None:
        if natsauth.is_permission_error(exc):
            # A denial: this role's credentials do not allow what it tried. Logged, never fatal.
            log.error("NATS refused an operation of role %s (its credentials do not allow it): %s", role,
                      str(exc).removeprefix("nats: "), extra={"role": role, "error": str(exc)})
        else:
            log.warning("nats error", extra={"error": repr(exc)})
        if isinstance(exc, nats.errors.SlowConsumerError):
            for hook in bus.on_possible_loss if bus is not None else ():
                hook(exc.sub)

    async def _disc() -> None:
        if bus is not None and bus.closing:
            log.debug("nats connection closed")
        else:
            log.warning("nats disconnected")

    async def _reconn() -> None:
        log.info("nats reconnected", extra={"server": connected_server(nc)})
        for hook in bus.on_possible_loss if bus is not None else ():
            hook(None)

    try:
        nc = await nats.connect(
            servers=server_list(settings.nats_url),  # a cluster's seed list: reconnects go to any node
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            # A server that hangs (its host frozen, a network partition) keeps the socket open: it is
            # noticed by unanswered pings, after 6-8 s here instead of nats-py's 4 minutes. Not less:
            # a PONG queues behind whatever the socket holds, and a relay forwarding 20k batches/s on
            # a busy host fell that far behind (1 s x 2 pings dropped a healthy connection).
            ping_interval=2,
            max_outstanding_pings=3,
            error_cb=_err,
            disconnected_cb=_disc,
            reconnected_cb=_reconn,
            **ident.options,
        )
    except Exception as exc:  # nats raises bare OSError/TimeoutError/NoServersError variants
        raise TransportError(f"cannot connect to NATS at {settings.nats_url}: {exc}") from exc
    log.info("nats connected", extra={"server": connected_server(nc), "nats_name": name})
    js = nc.jetstream(timeout=10)
    replicas = _replicas(js, settings)
    queue_js = nc.jetstream(prefix=TOKENPIPE_API, timeout=10) if ident.relay_account else None
    try:
        # Under tokenpipe's accounts the relay has its own (tokenpipe.relayaccount), which the admin
        # provisions and reads the registry of through an import.
        relay_js = await patiently(lambda: relay_account_api(nc), "the relay account's JetStream") \
            if role == "admin" else None
        if provision_streams and ident.provisions:
            await _provision_patiently(js, settings, registry=ident.registry and relay_js is None, replicas=replicas,
                                       apps=apps)
            if relay_js is not None:
                await patiently(lambda: provision_relay_account(relay_js, settings, replicas), "the relay's account")
        if ident.own_account:
            await provision_copy(js, settings, ident.owner, replicas=replicas)
        # An app may not touch the registry: it gets a handle that was never opened (any use is denied).
        meta_js = relay_js or js
        meta = await meta_js.key_value(META_BUCKET) if ident.registry else KeyValue(
            name=META_BUCKET, stream=META_STREAM, pre=f"$KV.{META_BUCKET}.", js=js, direct=False)
    except BaseException:
        await nc.close()  # a caller that retries must not leave a reconnecting connection behind
        raise
    bus = Bus(nc=nc, js=js, meta=meta, owner=ident.owner, registry=ident.registry, replicas=replicas,
              provisions=ident.provisions, secret=ident.secret,
              store_questions=role == "relay" and not ident.provisions, relay_js=relay_js, queue_js=queue_js)
    if role in ("relay", "app") and settings.placement_slots > 0:
        bus.placement = PlacementTable()
        await follow_summaries(nc, bus.placement)
    return bus


async def _provision_patiently(js: JetStreamContext, settings: Settings, **kw: Any) -> None:
    await patiently(lambda: provision(js, settings, **kw), "JetStream provisioning")


async def patiently(op: Callable[[], Awaitable[T]], what: str) -> T:
    """A start-up provisioning step ``op()``, tried again while JetStream does not answer in time: a
    cluster that just formed can time out its first requests (a generator that had loaded its model
    then exited on one: its streams in ``connect``, its placement slots' consumers in
    ``generator.service.placed``). A refusal (a bad configuration, too many replicas) is raised at once."""
    return await retrying(op, _PROVISIONING, what=what, worth=_unanswered)


def _unanswered(exc: BaseException) -> bool:
    """A provisioning failure whose cause is JetStream not answering, not refusing (every one is a
    :class:`TransportError`, which :func:`transient` alone would always try again)."""
    return exc.__cause__ is not None and transient(exc.__cause__)


def served_models(settings: Settings) -> list[str]:
    """``TOKENPIPE_MODELS`` as a list (empty: any model, an open bus)."""
    return [check_model_name(m.strip()) for m in settings.models.split(",") if m.strip()]


def intake_owners(apps: list[str]) -> list[str]:
    """The owners with an intake stream (:func:`intake_config`) under NATS accounts: the relay's and
    each application's."""
    return [RELAY_OWNER, *(a for a in apps if a != RELAY_OWNER)]


def requests_config(settings: Settings, replicas: int, intakes: list[str] | None = None) -> js_api.StreamConfig:
    """``TP_REQUESTS``, the queue every generator of a model takes requests from. ``intakes`` None (an
    open bus, or a process that does not know the applications): it stores every request itself.
    Else (the admin's provisioner, which knows them): nothing itself, and it sources the intake
    stream of each owner named (:func:`intake_owners`, :func:`intake_config`)."""
    models = served_models(settings)
    # Only the models served: a request for another one is stored nowhere (20 x 1 MB on
    # tp.req.nomodel.<app>, which nobody consumes, were kept for a day).
    subjects = ([model_request_filter(m) for m in models] or [REQUEST_WILDCARD]) if intakes is None else []
    return js_api.StreamConfig(
        name=REQUESTS_STREAM,
        subjects=subjects,
        # A sourced message keeps its subject (tp.req.<model>.<app>): the generators' consumers
        # filter by model, whoever stored it. The server drops its Nats-Expected-* headers on the way.
        sources=None if intakes is None else [js_api.StreamSource(name=intake_stream(a)) for a in sorted(intakes)],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.FILE,
        max_age=settings.request_max_age_s,
        # Bounded, refusing the newest (a queue must not drop a request it accepted): in all, and per
        # model and owner (one subject), so one owner cannot take every place in the queue.
        max_bytes=settings.request_max_bytes,
        max_msgs_per_subject=settings.request_max_per_owner,
        discard=js_api.DiscardPolicy.NEW,
        discard_new_per_subject=settings.request_max_per_owner > 0,  # the server refuses it without a bound
        duplicate_window=min(120.0, settings.request_max_age_s),
        num_replicas=replicas,
    )


def intake_config(settings: Settings, app: str, replicas: int) -> js_api.StreamConfig:
    """Owner ``app``'s intake stream ``TP_REQ_<app>`` (in tokenpipe's account; an application's or the
    relay's): where its requests land (its service import), sourced into ``TP_REQUESTS``.

    Of its own so that a publisher's JetStream headers are evaluated against its own requests
    only: in the shared TP_REQUESTS, an app's request with ``Nats-Expected-Last-Subject-Sequence:
    0`` and ``Nats-Expected-Last-Subject-Sequence-Subject: tp.req.<model>.alice`` was refused with
    "wrong last sequence: 132" while alice worked (and its PubAck's sequence counted every owner's
    requests); the relay's credential could read it the same way. Limits retention, not a work
    queue: a work queue would give each request up as soon as TP_REQUESTS copied it, and the bound
    per owner (``max_msgs_per_subject``, refusing the new one at the owner's publish) must count what
    is queued or running. The generator done with a request deletes it here (:func:`release_intake`)
    before its ack."""
    return js_api.StreamConfig(
        name=intake_stream(app),
        subjects=owner_request_subjects(app, served_models(settings)),
        retention=js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        max_age=settings.request_max_age_s,
        max_bytes=settings.request_max_bytes,
        max_msgs_per_subject=settings.request_max_per_owner,
        discard=js_api.DiscardPolicy.NEW,
        discard_new_per_subject=settings.request_max_per_owner > 0,
        duplicate_window=min(120.0, settings.request_max_age_s),
        num_replicas=replicas,
    )


async def release_intake(js: JetStreamContext, subject: str, headers: dict[str, str] | None) -> None:
    """Delete the intake copy (:func:`intake_config`) of the request ``TP_REQUESTS`` delivered with
    ``subject`` and ``headers``, once it is done with, just before it is acked or terminated: its
    place in its owner's bound is free again (before, so that a generator dying in between leaves no
    copy behind: the redelivered request is found final and only acked). A request stored in
    TP_REQUESTS itself (the relay's) has none. The source header is the server's own (a publisher's
    is refused); it must name the intake stream of the owner in the subject. Never raises: a copy
    it could not delete expires with the intake's ``max_age``."""
    source = (headers or {}).get("Nats-Stream-Source", "").split()
    if len(source) < 2:
        return
    stream, seq = source[0].split(":")[0], source[1]
    try:
        owner = owner_of_request(subject)
    except InvalidRequest:
        return
    if owner_of_intake(stream) != owner or not seq.isdigit():
        log.warning("a sourced request names another intake stream", extra={"subject": subject, "source": stream})
        return
    try:
        # Bounded: a delete its permissions do not allow (an app its credentials were not rendered
        # for) is never answered, and the caller's chain of appends must not wait 10 s on it.
        async with asyncio.timeout(_RELEASE_TIMEOUT_S):
            await js.delete_msg(stream, int(seq))
    except NotFoundError:
        pass  # deleted already (a request redelivered and finished twice), or expired
    except Exception as exc:  # nats errors and timeouts: the copy expires with max_age
        log.warning("cannot release a request's intake copy", extra={"stream": stream, "seq": seq,
                                                                     "error": repr(exc)})


def request_consumer_config(settings: Settings, model: str) -> js_api.ConsumerConfig:
    """The durable pull consumer ``gen-<model>`` that every generator of ``model`` shares. Where
    there are users only the admin creates and configures it (:func:`provision`, :func:`repair`);
    a generator binds to it (a generator that could create it set ``max_ack_pending=1``: every
    owner's first token then waited 4.5 s)."""
    return js_api.ConsumerConfig(
        # A name: nats-py then sends the filtered create form, which permissions can confine.
        name=consumer_name(model),
        durable_name=consumer_name(model),
        filter_subject=shared_request_filter(model),
        ack_policy=js_api.AckPolicy.EXPLICIT,
        # The same on one node and a cluster: a request redelivered while its holder still runs it
        # (a leader election delayed its progress acks, a freeze) is safe, because the store takes
        # appends from one writer only (tokenpipe.append).
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=-1,
    )


def consumer_drift(have: js_api.ConsumerConfig, want: js_api.ConsumerConfig) -> list[str]:
    """What differs in ``have`` from ``want`` (a request consumer), one word each."""
    out = []
    if abs(float(have.ack_wait or 0) - float(want.ack_wait or 0)) > 1e-3:
        out.append("ack_wait")
    for key in ("max_deliver", "filter_subject", "ack_policy"):
        if getattr(have, key) != getattr(want, key):
            out.append(key)
    if (have.max_ack_pending or -1) not in (-1, 0) and have.max_ack_pending != want.max_ack_pending:
        out.append("max_ack_pending")  # the server reports its default (1000, or -1) for -1
    return out


def _api_of(js: JetStreamContext) -> tuple[NATS, str]:
    """The connection and API prefix under ``js`` (the slot consumers are made through raw API calls)."""
    return js._nc, js._prefix


async def _ensure_consumers(js: JetStreamContext, settings: Settings) -> list[str]:
    """Create, or restore in place, the request consumer of each served model and then (their filters
    are disjoint from its own only once it is restored) its placement slots' consumers; what was wrong."""
    fixed = []
    for model in served_models(settings):
        want = request_consumer_config(settings, model)
        try:
            drift = consumer_drift((await js.consumer_info(REQUESTS_STREAM, consumer_name(model))).config, want)
        except NotFoundError:
            drift = ["missing"]
        if drift:
            await js.add_consumer(REQUESTS_STREAM, want)  # create-or-update: same name, these fields
            fixed.append(f"consumer {consumer_name(model)}: {', '.join(drift)}")
    nc, prefix = _api_of(js)
    fixed += await ensure_slot_consumers(nc, settings, served_models(settings), prefix)
    return fixed


async def provision_copy(js: JetStreamContext, settings: Settings, owner: str, *, replicas: int = 1) -> None:
    """An app in its own account (tokenpipe.natsconfig): its ``TP_TOKENS`` there, which keeps the
    token batches imported from tokenpipe's account (``tp.tok.<owner>.>``) with the same retention."""
    try:
        config = tokens_config(settings, [owner_tokens(owner)], replicas)
        # Within the account's storage budget (tokenpipe.natsconfig.app_limits): a stream asking for more
        # is refused, and one with no size cap would stop storing once the budget is full; capped at
        # it, the oldest batches go first. Each replica counts against it.
        budget = ((await js.account_info()).limits.max_storage or -1) // max(1, replicas)
        if budget > 0 and not 0 < (config.max_bytes or -1) <= budget:
            config.max_bytes = budget
        await ensure_stream(js, config, settings)
    except TransportError:
        raise
    except Exception as exc:  # nats.js.errors.* and timeouts; one translation point
        raise TransportError(f"cannot provision the app's token store: {exc}") from exc


async def _ensure_requests(js: JetStreamContext, settings: Settings, replicas: int, apps: list[str] | None) -> None:
    """TP_REQUESTS and (``apps`` given) the intake stream of the relay and of each application, in an
    order the server accepts: TP_REQUESTS first gives up its own subjects (two streams of one account
    may not share a subject; the relay's were TP_REQUESTS' own), then the intake streams that are
    missing are created, then TP_REQUESTS sources them. A source added before its stream exists is
    retried by the server only after ~30 s; one whose stream was deleted and is created again is
    dropped and added back here."""
    if apps is None:
        await ensure_stream(js, requests_config(settings, replicas), settings)
        return
    owners = intake_owners(apps)
    exist = []
    for owner in owners:
        try:
            await js.stream_info(intake_stream(owner))
            exist.append(owner)
        except NotFoundError:
            pass
    await ensure_stream(js, requests_config(settings, replicas, exist), settings)
    for owner in owners:
        await ensure_stream(js, intake_config(settings, owner, replicas), settings)
    if len(exist) < len(owners):
        await ensure_stream(js, requests_config(settings, replicas, owners), settings)


async def provision(js: JetStreamContext, settings: Settings, *, registry: bool = True, replicas: int = 1,
                    apps: list[str] | None = None) -> None:
    """Create or update the request/token streams, the request consumer of each served model
    (:func:`served_models`) and (``registry``: only the roles that may touch it, tokenpipe.natsauth)
    the meta bucket, with ``replicas`` replicas (existing ones are scaled up in place). ``apps``:
    the applications, each with an intake stream that TP_REQUESTS sources (the admin's
    provisioner; None: TP_REQUESTS' subjects and sources are kept as they are, or on an open bus
    it takes every request itself: :func:`requests_config`). Safe to race."""
    try:
        await _ensure_requests(js, settings, replicas, apps)
        await _ensure_consumers(js, settings)
        await ensure_stream(js, tokens_config(settings, [TOKEN_WILDCARD], replicas), settings)
        if not registry:
            return
        await ensure_registry(js, settings, replicas)
    except TransportError:
        raise
    except Exception as exc:  # nats.js.errors.* and timeouts; one translation point
        raise TransportError(f"JetStream provisioning failed: {exc}") from exc


async def missing(js: JetStreamContext, *, settings: Settings, registry: bool = True,
                  limits: bool = False, apps: list[str] | None = None, ask: NATS | None = None,
                  relay_js: JetStreamContext | None = None) -> list[str]:
    """The streams (and, with ``registry``, those of the meta bucket and of the Batch API's buckets)
    that tokenpipe provisions and that do not exist now, also each one that is broken (sealed;
    retention policy, storage or subjects changed) and, with ``limits``, each whose age or size limit
    differs from ``settings`` (only the admin judges those: another process may run with other
    settings), as a sentence that says what is wrong; with ``apps``, also each application's
    intake stream and TP_REQUESTS' sources of them (:func:`requests_config`). ``ask``: the connection of
    a role that may not look at TP_REQUESTS and TP_TOKENS itself (``Bus.store_questions``): the admin
    tells their configuration (tokenpipe.storeinfo). ``relay_js``: the relay's own account (the relay's
    own JetStream, or the admin's import of it), whose copy, registry and buckets are checked there
    (tokenpipe.relayaccount) instead of ``registry``'s in ``js``. Raises :class:`TransportError` when
    JetStream cannot be asked."""
    gone: list[str] = []
    intakes = None if apps is None else intake_owners(apps)
    wanted = {REQUESTS_STREAM: requests_config(settings, 1, intakes),
              TOKENS_STREAM: tokens_config(settings, [TOKEN_WILDCARD], 1),
              **{intake_stream(a): intake_config(settings, a, 1) for a in intakes or ()}}
    registry = registry and relay_js is None
    for name in (REQUESTS_STREAM, TOKENS_STREAM, *((META_STREAM, *BATCH_STREAMS) if registry else ()),
                 *(intake_stream(a) for a in intakes or ())):
        if ask is not None and name in (REQUESTS_STREAM, TOKENS_STREAM):
            config = await ask_config(ask, name, _ASK_TIMEOUT_S)
        else:
            try:
                config = (await js.stream_info(name)).config
            except NotFoundError:
                config = None
            except Exception as exc:  # timeouts, no responders while JetStream recovers
                raise TransportError(f"cannot check JetStream streams: {exc}") from exc
        if config is None:
            gone.append(name)
        elif name in wanted:
            gone.extend(_drift(config, wanted[name], limits))
    if limits and REQUESTS_STREAM not in gone:
        gone.extend(await _consumers_drift(js, settings))
    if relay_js is not None:
        gone.extend(await relay_account_missing(relay_js))
    return gone


async def _consumers_drift(js: JetStreamContext, settings: Settings) -> list[str]:
    """The request consumers of the served models that are missing or reconfigured (the admin's)."""
    out = []
    for model in served_models(settings):
        try:
            have = (await js.consumer_info(REQUESTS_STREAM, consumer_name(model))).config
        except NotFoundError:
            out.append(f"consumer {consumer_name(model)} is missing (the admin re-creates it)")
            continue
        except Exception as exc:  # timeouts, no responders while JetStream recovers
            raise TransportError(f"cannot check JetStream consumers: {exc}") from exc
        drift = consumer_drift(have, request_consumer_config(settings, model))
        if drift:
            out.append(f"consumer {consumer_name(model)}: {', '.join(drift)} changed (the admin restores it)")
    nc, prefix = _api_of(js)
    return out + await slots_drift(nc, settings, served_models(settings), prefix)


# Judged by the admin alone (``limits``): they follow its settings, which another process need not share
# (the served models decide TP_REQUESTS' subjects, the applications its sources).
_REQUEST_LIMITS = ("subjects", "max_age", "max_bytes", "max_msgs_per_subject", "discard", "discard_new_per_subject")
_ADMINS_KEYS = {REQUESTS_STREAM: _REQUEST_LIMITS, TOKENS_STREAM: ("max_age", "max_bytes")}


def _drift(have: js_api.StreamConfig, want: js_api.StreamConfig, limits: bool) -> list[str]:
    """What is wrong with stream ``have`` against ``want``, one sentence each."""
    name = want.name or ""
    if have.sealed:
        return [f"{name} is sealed. {SEALED_ACTION.format(name)}"]
    out = []
    admins = _ADMINS_KEYS.get(name, _REQUEST_LIMITS if owner_of_intake(name) else ())
    keys = ("retention", "storage", "subjects", *admins)
    for key in dict.fromkeys(k for k in keys if limits or k not in admins):
        h, w = getattr(have, key), getattr(want, key)
        if w is not None and not same_setting(key, h, w):
            out.append(f"{name}: {key} is {h!r}, tokenpipe provisions {w!r} (the admin restores it)")
    if limits and want.sources is not None and source_names(have) != source_names(want):
        out.append(f"{name}: sources are {source_names(have)}, tokenpipe provisions {source_names(want)} "
                   "(the admin restores them)")
    return out


async def repair(js: JetStreamContext, settings: Settings, *, registry: bool = True,
                 provision_streams: bool = True, restore_limits: bool = False,
                 apps: list[str] | None = None, ask: NATS | None = None,
                 relay_js: JetStreamContext | None = None) -> list[str]:
    """Re-provision whatever :func:`missing` reports (deleted, or broken); what was wrong.
    ``registry``: whether this role may touch the meta bucket (``Bus.registry``);
    ``provision_streams``: whether it may configure streams (``Bus.provisions``), else it only
    reports; ``restore_limits``: also put back age and size limits that differ from ``settings``
    (the admin's provisioner: one process's settings, not every role's); ``apps``: the applications
    whose intake streams it keeps (the admin's provisioner, :func:`provision`); ``ask``, ``relay_js``: as
    :func:`missing` (the admin re-provisions the relay's account through ``relay_js``)."""
    gone = await missing(js, registry=registry, settings=settings, limits=restore_limits, apps=apps, ask=ask,
                         relay_js=relay_js)
    if gone and provision_streams:
        log.warning("JetStream state tokenpipe owns is missing or changed; re-provisioning",
                    extra={"missing": "; ".join(gone)})
        replicas = _replicas(js, settings)
        await provision(js, settings, registry=registry and relay_js is None, replicas=replicas, apps=apps)
        if relay_js is not None:
            await provision_relay_account(relay_js, settings, replicas)
    elif gone:
        log.error("JetStream state tokenpipe owns is missing or changed; tokenpipe's admin repairs it",
                  extra={"missing": "; ".join(gone)})
    return gone


def _replicas(js: JetStreamContext, settings: Settings) -> int:
    """``TOKENPIPE_REPLICAS`` resolved against the connected server's cluster. nats-py keeps the
    server's INFO (cluster name, advertised nodes) only in private fields."""
    nc = getattr(js, "_nc", None)
    return resolve_replicas(settings.replicas, getattr(nc, "_server_info", None) or {})
