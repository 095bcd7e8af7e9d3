"""The relay's own NATS account (``RELAY``, issue 48): its copy of its token streams, its registry and
its Batch API buckets, provisioned and repaired by the admin through an import.

Why an account: inside tokenpipe's account a client may publish an allowed subject with any reply
subject, and the server's own answers (a direct get's message, an error PubAck, a JetStream API
reply) then land there unchecked. With the relay's credential that stored junk and pre-planted a
batch in another owner's history (``tp.tok.alice.<id>``), and its ``STREAM.INFO`` listed every
owner's stream ids. In an account of its own every answer the relay provokes lands in its own
account (tokenpipe.natsconfig maps each imported service's reply back there), and its JetStream
holds only its own streams:

- ``TP_TOKENS``: a copy of tokenpipe's, *sourced* from it and filtered to ``tp.tok.relay.>`` (the
  server's own consumer in tokenpipe's account, created through the one JetStream call the relay's
  account imports for it, delivering on ``tp.relaycopy.>``). Sourcing, not the live batches, fills
  it: a copy lost nothing while the relay's account was unavailable, it catches up. It lags
  tokenpipe's store by a moment, as a replica does; readers count a stream's batches with
  tokenpipe's leader (tokenpipe.storeinfo) and read again when the copy is short.
- ``tp_streams`` (the registry) and the Batch API's ``tp_files``/``tp_batches``.

The relay may not create or configure any of them (a relay that could edit its copy's source could
choose where tokenpipe's account delivers it): the admin does, through ``$JS.RELAY.API`` (the relay
account's JetStream API, imported into tokenpipe's account for it alone), at start and every repair
round (:func:`provision_relay_account`, :func:`relay_account_missing`).
"""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from .batchstore import BATCH_STREAMS
from .errors import TransportError
from .settings import Settings
from .streamsetup import SEALED_ACTION, ensure_registry, ensure_stream, source_names, tokens_config
from .subjects import (
    META_STREAM,
    RELAY_API,
    RELAY_COPY_PREFIX,
    RELAY_OWNER,
    TOKENPIPE_API,
    TOKENS_STREAM,
    owner_tokens,
)

__all__ = ["copy_config", "provision_relay_account", "relay_account_api", "relay_account_missing"]

log = logging.getLogger(__name__)

COPY = f"{TOKENS_STREAM} (the relay's copy)"  # how the copy is named where something is wrong with it


def copy_config(settings: Settings, replicas: int) -> js_api.StreamConfig:
    """The relay's ``TP_TOKENS``: no subjects of its own, the relay's batches sourced from tokenpipe's
    (readers name the stream), with tokenpipe's retention."""
    config = tokens_config(settings, [], replicas)
    config.subjects = None
    config.sources = [js_api.StreamSource(
        name=TOKENS_STREAM, filter_subject=owner_tokens(RELAY_OWNER),
        external=js_api.ExternalStream(api=TOKENPIPE_API, deliver=f"{RELAY_COPY_PREFIX}.copy"))]
    return config


async def relay_account_api(nc: NATS, timeout: float = 10.0) -> JetStreamContext | None:
    """The relay account's JetStream API as the admin reaches it (``$JS.RELAY.API``); None where there
    is none (an open bus, or accounts tokenpipe did not write): nobody answers there."""
    rjs = nc.jetstream(prefix=RELAY_API, timeout=timeout)
    try:
        await rjs.account_info()
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):  # nats-py's "no responders"
        return None
    except Exception as exc:  # timeouts while JetStream starts: the caller retries
        raise TransportError(f"the relay account's JetStream did not answer: {exc!r}") from exc
    return rjs


async def provision_relay_account(rjs: JetStreamContext, settings: Settings, replicas: int) -> None:
    """Create or update the relay account's copy of its tokens, registry and Batch API buckets
    (``rjs``: :func:`relay_account_api`). Safe to race."""
    try:
        await ensure_stream(rjs, copy_config(settings, replicas), settings)
        await ensure_registry(rjs, settings, replicas)
    except TransportError:
        raise
    except Exception as exc:  # nats.js.errors.* and timeouts; one translation point
        raise TransportError(f"provisioning the relay's account failed: {exc}") from exc


async def relay_account_missing(js: JetStreamContext) -> list[str]:
    """What is missing or broken in the relay's account (``js``: its JetStream, the relay's own or the
    admin's :func:`relay_account_api`), a sentence each: the copy (gone, sealed, or not sourcing
    tokenpipe's store), the registry, the Batch API's buckets."""
    gone: list[str] = []
    for name in (TOKENS_STREAM, META_STREAM, *BATCH_STREAMS):
        shown = COPY if name == TOKENS_STREAM else name
        try:
            config = (await js.stream_info(name)).config
        except NotFoundError:
            gone.append(shown)
            continue
        except Exception as exc:  # timeouts, no responders while JetStream recovers
            raise TransportError(f"cannot check the relay account's streams: {exc}") from exc
        if config.sealed:
            gone.append(f"{shown} is sealed. {SEALED_ACTION.format(name)}")
        elif name == TOKENS_STREAM and source_names(config) != [TOKENS_STREAM]:
            gone.append(f"{shown}: sources are {source_names(config)}, tokenpipe provisions {[TOKENS_STREAM]} "
                        "(the admin restores them)")
    return gone
