"""Creating and updating the streams and buckets tokenpipe provisions, in whichever account: the
shared helpers of :mod:`tokenpipe.bus` (tokenpipe's own streams, an app's copy of its tokens) and
:mod:`tokenpipe.relayaccount` (the relay's account)."""

from __future__ import annotations

import dataclasses
import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from .batchstore import provision_batch_stores
from .cluster import replicas_to_keep
from .errors import TransportError
from .settings import Settings
from .subjects import META_BUCKET, META_STREAM, TOKENS_STREAM

__all__ = ["SEALED_ACTION", "ensure_registry", "ensure_stream", "same_setting", "source_names", "tokens_config",
           "update_stream"]

log = logging.getLogger(__name__)


def same_setting(key: str, have: object, want: object) -> bool:
    """Whether a stream's ``key`` as the server reports it (``have``) is the one provisioned (``want``):
    the server leaves out what is empty or unlimited (no subjects of its own: a stream that only sources)."""
    if key == "subjects":
        return (have or None) == (want or None)
    if key == "max_bytes":
        return have == want or (have in (-1, None) and want in (-1, None))
    return have == want


def source_names(config: js_api.StreamConfig) -> list[str]:
    """The names of the streams ``config`` sources, sorted."""
    return sorted(s.name for s in config.sources or ())


async def ensure_stream(js: JetStreamContext, config: js_api.StreamConfig, settings: Settings) -> None:
    """Create ``config``'s stream, or update the one there to it (replicas only ever scaled as
    :func:`~tokenpipe.cluster.replicas_to_keep` allows; a sealed one is left, and logged)."""
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.APIError as exc:
            if (config.num_replicas or 1) == 1:
                raise
            raise TransportError(
                f"cannot create stream {config.name} with {config.num_replicas} replicas: {exc.description}. "
                "Set TOKENPIPE_REPLICAS to at most the number of JetStream servers") from exc
        log.info("stream created", extra={"stream": config.name, "replicas": config.num_replicas})
        return
    have = info.config
    if have.sealed:
        # NATS cannot unseal a stream: say what the admin must do (missing() reports it too).
        log.error("stream is sealed", extra={"stream": config.name, "action": SEALED_ACTION.format(config.name)})
        return
    config.num_replicas = replicas_to_keep(have.num_replicas or 1, config.num_replicas or 1, settings.replicas)
    if config.sources is None and have.sources:
        # Provisioned without knowing the applications (not the admin's provisioner): their intake
        # streams and TP_REQUESTS' subjects stay as the provisioner made them (widening the subjects
        # would overlap the intake streams, and an update without sources would drop them).
        config.subjects, config.sources = have.subjects, have.sources
    wanted = ("subjects", "max_age", "max_bytes", "max_msgs_per_subject", "discard", "discard_new_per_subject",
              "duplicate_window", "allow_direct", "num_replicas")
    changed = [k for k in wanted if getattr(config, k) is not None and not same_setting(k, getattr(have, k),
                                                                                      getattr(config, k))]
    if changed or (config.sources is not None and source_names(have) != source_names(config)):
        # Retention/storage can't change in place; the rest can (replicas included), so settings apply.
        await update_stream(js, config, have.num_replicas or 1)


async def update_stream(js: JetStreamContext, config: js_api.StreamConfig, had_replicas: int) -> None:
    try:
        await js.update_stream(config)
    except nats.js.errors.APIError as exc:
        if config.num_replicas == had_replicas:
            raise
        raise TransportError(
            f"cannot change stream {config.name} from {had_replicas} to {config.num_replicas} replicas: "
            f"{exc.description}. Set TOKENPIPE_REPLICAS to the number of JetStream servers (at most), "
            f"or to {had_replicas} to keep it as it is") from exc
    log.info("stream updated", extra={"stream": config.name, "replicas": config.num_replicas})


SEALED_ACTION = ("NATS cannot unseal a stream: nothing more can be stored in it. Copy what you need "
                  "(`nats stream backup {0}`), then delete it (`nats stream rm {0}` as the admin); "
                  "tokenpipe's admin re-creates it within seconds")


def tokens_config(settings: Settings, subjects: list[str], replicas: int) -> js_api.StreamConfig:
    """A ``TP_TOKENS`` stream's configuration (tokenpipe's, an app's copy, the relay's copy) on ``subjects``."""
    return js_api.StreamConfig(
        name=TOKENS_STREAM,
        subjects=subjects,
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
        num_replicas=replicas,
    )


async def ensure_registry(js: JetStreamContext, settings: Settings, replicas: int) -> None:
    """The stream registry (the ``tp_streams`` bucket) and the Batch API's buckets, created or scaled."""
    try:
        await js.key_value(META_BUCKET)
    except NotFoundError:
        # Kept twice as long as the tokens, so an expired stream is told apart from an unknown one.
        await js.create_key_value(
            js_api.KeyValueConfig(bucket=META_BUCKET, ttl=2 * settings.token_max_age_s, history=1,
                                  replicas=replicas)
        )
    else:
        await _scale_bucket(js, replicas, settings)
    await provision_batch_stores(js, settings, replicas)  # the Batch API's (the relay's, like the registry)


async def _scale_bucket(js: JetStreamContext, replicas: int, settings: Settings) -> None:
    """A KV bucket is a stream (``KV_<bucket>``): its replicas change like any stream's."""
    info = await js.stream_info(META_STREAM)
    had = info.config.num_replicas or 1
    want = replicas_to_keep(had, replicas, settings.replicas)
    if want != had:
        await update_stream(js, dataclasses.replace(info.config, num_replicas=want), had)
