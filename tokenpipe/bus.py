"""NATS connection and idempotent JetStream provisioning."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from .errors import TransportError
from .settings import Settings
from .subjects import META_BUCKET, REQUEST_WILDCARD, REQUESTS_STREAM, TOKEN_WILDCARD, TOKENS_STREAM

__all__ = ["Bus", "connect", "missing", "provision", "repair", "REPAIR_INTERVAL_S"]

log = logging.getLogger(__name__)

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
    closing: bool = False

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        self.closing = True  # the disconnect that follows is ours, not news
        try:
            await self.nc.drain()
        except nats.errors.ConnectionReconnectingError:
            await self.nc.close()  # the server is gone: nothing can be drained to it


async def connect(settings: Settings, *, name: str, provision_streams: bool = True) -> Bus:
    """Connect (retrying forever on disconnect), provision streams, open the meta bucket."""

    bus: Bus | None = None

    async def _err(exc: Exception) -> None:
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
        log.info("nats reconnected")
        for hook in bus.on_possible_loss if bus is not None else ():
            hook(None)

    try:
        nc = await nats.connect(
            settings.nats_url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            error_cb=_err,
            disconnected_cb=_disc,
            reconnected_cb=_reconn,
        )
    except Exception as exc:  # nats raises bare OSError/TimeoutError/NoServersError variants
        raise TransportError(f"cannot connect to NATS at {settings.nats_url}: {exc}") from exc
    js = nc.jetstream(timeout=10)
    if provision_streams:
        await provision(js, settings)
    meta = await js.key_value(META_BUCKET)
    bus = Bus(nc=nc, js=js, meta=meta)
    return bus


async def _ensure_stream(js: JetStreamContext, config: js_api.StreamConfig) -> None:
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        log.info("stream created", extra={"stream": config.name})
        return
    have = info.config
    wanted: dict[str, Any] = {
        "subjects": config.subjects,
        "max_age": config.max_age,
        "max_bytes": config.max_bytes,
        "duplicate_window": config.duplicate_window,
        "allow_direct": config.allow_direct,
    }
    if any(getattr(have, k) != v for k, v in wanted.items() if v is not None):
        # Retention/storage can't change in place; the rest can, so settings changes apply.
        await js.update_stream(config)
        log.info("stream updated", extra={"stream": config.name})


async def provision(js: JetStreamContext, settings: Settings) -> None:
    """Create or update the request/token streams and the meta bucket. Safe to race."""
    try:
        await _ensure_stream(
            js,
            js_api.StreamConfig(
                name=REQUESTS_STREAM,
                subjects=[REQUEST_WILDCARD],
                retention=js_api.RetentionPolicy.WORK_QUEUE,
                storage=js_api.StorageType.FILE,
                max_age=settings.request_max_age_s,
                duplicate_window=min(120.0, settings.request_max_age_s),
            ),
        )
        await _ensure_stream(
            js,
            js_api.StreamConfig(
                name=TOKENS_STREAM,
                subjects=[TOKEN_WILDCARD],
                retention=js_api.RetentionPolicy.LIMITS,
                storage=js_api.StorageType.FILE,
                max_age=settings.token_max_age_s,
                max_bytes=settings.token_max_bytes,
                # Long enough to cover an outage plus PubAck timeouts, so republished batches dedup;
                # the server requires it to be <= max_age.
                duplicate_window=min(120.0, settings.token_max_age_s),
                # Readers catch up with "last message for subject" direct gets, which any server
                # answers without a trip through the JetStream API queue.
                allow_direct=True,
            ),
        )
        try:
            await js.key_value(META_BUCKET)
        except NotFoundError:
            # Kept twice as long as the tokens, so an expired stream is told apart from an unknown one.
            await js.create_key_value(
                js_api.KeyValueConfig(bucket=META_BUCKET, ttl=2 * settings.token_max_age_s, history=1)
            )
    except TransportError:
        raise
    except Exception as exc:  # nats.js.errors.* and timeouts; one translation point
        raise TransportError(f"JetStream provisioning failed: {exc}") from exc


async def missing(js: JetStreamContext) -> list[str]:
    """The streams (and the meta bucket's stream) that tokenpipe provisions and that do not exist now.
    Raises :class:`TransportError` when JetStream cannot be asked."""
    gone: list[str] = []
    for name in (REQUESTS_STREAM, TOKENS_STREAM, f"KV_{META_BUCKET}"):
        try:
            await js.stream_info(name)
        except NotFoundError:
            gone.append(name)
        except Exception as exc:  # timeouts, no responders while JetStream recovers
            raise TransportError(f"cannot check JetStream streams: {exc}") from exc
    return gone


async def repair(js: JetStreamContext, settings: Settings) -> list[str]:
    """Re-provision whatever :func:`missing` reports (someone deleted it); what was missing."""
    gone = await missing(js)
    if gone:
        log.warning("JetStream state tokenpipe owns is missing; re-provisioning", extra={"missing": ",".join(gone)})
        await provision(js, settings)
    return gone
