"""Where the Batch API keeps its state on the bus: the files in a JetStream object store
(``tp_files``) and the file records and batch states in a KV bucket (``tp_batches``), both
replicated like tokenpipe's streams and kept for ``batch_retention_s``.

Provisioned with the other streams (:func:`tokenpipe.bus.provision`, the admin's), so that a
relay restarted on any node finds every batch where it left it.
"""

from __future__ import annotations

import dataclasses
import logging

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from .cluster import replicas_to_keep
from .settings import Settings
from .subjects import BATCHES_BUCKET, BATCHES_STREAM, FILES_BUCKET, FILES_STREAM

__all__ = ["provision_batch_stores", "BATCH_STREAMS"]

log = logging.getLogger(__name__)

BATCH_STREAMS = (FILES_STREAM, BATCHES_STREAM)  # the streams JetStream keeps the two buckets in


async def provision_batch_stores(js: JetStreamContext, settings: Settings, replicas: int) -> None:
    """Create the object store and the KV bucket when missing; scale an existing one's replicas
    and put its retention back to ``batch_retention_s`` (a stream's age limit changes in place).
    Safe to race: a create that lost the race finds the other's bucket."""
    try:
        await js.stream_info(FILES_STREAM)
    except NotFoundError:
        # discard=new (nats-py's object-store default): a full store refuses the new file, never
        # drops part of an old one.
        await js.create_object_store(FILES_BUCKET, js_api.ObjectStoreConfig(
            bucket=FILES_BUCKET, description="tokenpipe Batch API files", ttl=settings.batch_retention_s,
            storage=js_api.StorageType.FILE, replicas=replicas))
        log.info("object store created", extra={"bucket": FILES_BUCKET, "replicas": replicas})
    try:
        await js.stream_info(BATCHES_STREAM)
    except NotFoundError:
        await js.create_key_value(js_api.KeyValueConfig(
            bucket=BATCHES_BUCKET, description="tokenpipe Batch API file records and batches",
            ttl=settings.batch_retention_s, history=1, replicas=replicas))
        log.info("KV bucket created", extra={"bucket": BATCHES_BUCKET, "replicas": replicas})
    for name in BATCH_STREAMS:
        config = (await js.stream_info(name)).config
        had = config.num_replicas or 1
        want = replicas_to_keep(had, replicas, settings.replicas)
        if want != had or abs(float(config.max_age or 0) - settings.batch_retention_s) > 1e-3:
            await js.update_stream(dataclasses.replace(config, num_replicas=want, max_age=settings.batch_retention_s))
            log.info("stream updated", extra={"stream": name, "replicas": want})
