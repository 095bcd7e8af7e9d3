"""The store's answers for the relay: leader-side counts and the shared streams' configuration,
answered by the admin (issue 48).

``STREAM.INFO`` takes its subjects filter in the request body, which no permission sees: a relay
allowed ``STREAM.INFO`` on tokenpipe's ``TP_TOKENS`` or ``TP_REQUESTS`` listed every owner's stream ids
and every application with a request queued or running. Under NATS authorization the relay works in an
account of its own (tokenpipe.relayaccount), which holds a copy of its batches only; for the counts of
tokenpipe's store, which its copy may lag, and for /readyz, it asks the admin's provisioner
(``tokenpipe up``'s, the Helm chart's) three narrow questions, each about the relay's own subjects only:

- ``tp.store.count.<id>``: how many messages ``TP_TOKENS``' leader holds on ``tp.tok.relay.<id>``
  (:func:`tokenpipe.streams.stored_count`);
- ``tp.store.pending.<model>``: how many of the relay's requests for ``<model>`` ``TP_REQUESTS``
  holds, queued or running (:func:`tokenpipe.streams.pending_requests`);
- ``tp.store.config.<stream>``: the configuration of ``TP_TOKENS`` or ``TP_REQUESTS`` that
  ``/readyz`` checks (sealed, retention, storage, subjects), never its sources, which name the
  applications (:func:`tokenpipe.bus.missing`).

The answerer builds every filter from the subject's one last token (a stream id or a model name,
checked) and answers only onto the relay's inboxes or a reply the server mapped from the relay's
account: the asker chooses the reply subject, and an answer sent to ``tp.tok.alice.<id>`` inside
tokenpipe's account would be stored in alice's history.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from .errors import TokenpipeError, TransportError
from .natsauth import inbox_prefix
from .subjects import (
    RELAY_OWNER,
    REQUESTS_STREAM,
    STORE_PREFIX,
    TOKENS_STREAM,
    check_model_name,
    check_stream_id,
    request_subject,
    token_subject,
)

__all__ = ["StoreAnswers", "ask_config", "ask_count", "ask_pending", "leader_count", "requests_held"]

log = logging.getLogger(__name__)

_QUEUE = "tp-store"
_STREAMS = (TOKENS_STREAM, REQUESTS_STREAM)
_CONFIG_KEYS = ("name", "subjects", "retention", "storage", "sealed")  # what /readyz judges without limits
_REPLY_TO = f"{inbox_prefix('relay')}."
# A question from the relay's own account (tokenpipe.relayaccount) comes through a service import,
# whose reply subject the server made (``_R_.…``) and maps back into the relay's account: whatever the
# relay chose there, the answer lands in its account.
_IMPORTED_REPLY = "_R_."


class StoreAnswers:
    """The admin's side: answers the relay's questions on ``tp.store.>`` (a queue group, so that more
    than one provisioner may run)."""

    def __init__(self, nc: NATS, js: JetStreamContext, timeout: float = 5.0) -> None:
        self.nc = nc
        self.js = js
        self.timeout = timeout
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{STORE_PREFIX}.>", queue=_QUEUE, cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for task in list(self._tasks):
            task.cancel()

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply.startswith((_REPLY_TO, _IMPORTED_REPLY)):
            log.warning("store question refused: not asked from the relay's inbox",
                        extra={"subject": msg.subject, "reply": msg.reply})
            return
        # One task each: a question waits on the stream's leader (seconds in an election), and the
        # subscription's callbacks run one at a time.
        task = asyncio.get_running_loop().create_task(self._answer(msg), name="store-answer")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            answer = await asyncio.wait_for(self.answer(msg.subject), self.timeout)
        except TokenpipeError as exc:  # a malformed question, or JetStream not answering
            answer = {"error": exc.message}
        except TimeoutError:
            answer = {"error": f"JetStream did not answer within {self.timeout:g} s"}
        try:
            await self.nc.publish(msg.reply, json.dumps(answer).encode())
        except Exception as exc:  # the connection is going away: the relay's request times out and retries
            log.warning("store answer not sent", extra={"error": repr(exc)})

    async def answer(self, subject: str) -> dict[str, Any]:
        """The answer to the question on ``subject``; :class:`TokenpipeError` for one that cannot be
        asked (malformed, or JetStream not answering)."""
        parts = subject.split(".")
        if len(parts) != 4 or ".".join(parts[:2]) != STORE_PREFIX:
            raise TransportError(f"not a store question: {subject!r}")
        kind, name = parts[2], parts[3]
        try:
            if kind == "count":
                return {"n": await leader_count(self.js, TOKENS_STREAM,
                                                token_subject(RELAY_OWNER, check_stream_id(name)))}
            if kind == "pending":
                return {"n": await requests_held(self.js, check_model_name(name), RELAY_OWNER)}
            if kind == "config" and name in _STREAMS:
                try:
                    config = (await self.js.stream_info(name)).config
                except NotFoundError:
                    return {"missing": True}
                return {"config": _config_json(config)}
        except TokenpipeError:
            raise
        except Exception as exc:  # nats timeouts and API errors while the stream has no leader
            raise TransportError(f"JetStream did not answer: {exc!r}") from exc
        raise TransportError(f"no such store question: {kind} {name!r}")


async def leader_count(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject`` (a wildcard: on each subject it matches), as
    its leader counts them (``STREAM.INFO`` with a subjects filter); nats' own errors pass through."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum(int(n) for n in (info.state.subjects or {}).values())


async def requests_held(js: JetStreamContext, model: str, owner: str) -> int:
    """How many of ``owner``'s requests for ``model`` ``TP_REQUESTS`` holds, in both forms: the shared
    queue's subject and those placed on a generator (tokenpipe.placement)."""
    own = request_subject(model, owner)
    return await leader_count(js, REQUESTS_STREAM, own) + await leader_count(js, REQUESTS_STREAM, f"{own}.>")


def _config_json(config: StreamConfig) -> dict[str, Any]:
    raw = config.as_dict()
    return {k: raw[k] for k in _CONFIG_KEYS if k in raw}


async def _ask(nc: NATS, question: str, timeout: float) -> dict[str, Any]:
    try:
        msg = await nc.request(f"{STORE_PREFIX}.{question}", b"", timeout=timeout)
        answer: dict[str, Any] = json.loads(msg.data)
    except NoRespondersError as exc:
        raise TransportError("the store's answers are the admin's and nobody answered: is the provisioner "
                             "running (tokenpipe up runs one; the Helm chart's provisioner Deployment)?") from exc
    except Exception as exc:  # nats timeouts; a malformed answer
        raise TransportError(f"the store did not answer {question!r}: {exc!r}") from exc
    if "error" in answer:
        raise TransportError(f"the store could not answer {question!r}: {answer['error']}")
    return answer


async def ask_count(nc: NATS, stream_id: str, timeout: float) -> int:
    """How many messages ``TP_TOKENS``' leader holds for the relay's stream ``stream_id``."""
    return int((await _ask(nc, f"count.{stream_id}", timeout))["n"])


async def ask_pending(nc: NATS, model: str, timeout: float) -> int:
    """How many of the relay's requests for ``model`` ``TP_REQUESTS`` holds (queued or running)."""
    return int((await _ask(nc, f"pending.{model}", timeout))["n"])


async def ask_config(nc: NATS, stream: str, timeout: float) -> StreamConfig | None:
    """``stream``'s configuration as :func:`tokenpipe.bus.missing` judges it; None where it does not exist."""
    answer = await _ask(nc, f"config.{stream}", timeout)
    if answer.get("missing"):
        return None
    return StreamConfig.from_response(dict(answer["config"]))
