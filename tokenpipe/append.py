"""The single-writer rule, enforced by JetStream: every token batch is a conditional append.

A batch goes to ``tp.tok.<owner>.<id>`` with ``Nats-Expected-Last-Subject-Sequence`` set to the
stream sequence of that stream's previous stored batch (0 for the first: nats-server reads 0 as
"nothing stored on this subject yet"). JetStream stores it only if nothing else was stored on
the subject since, so two generators that both believe they hold a stream (a frozen holder that
thawed after its request was redelivered) cannot both append: the second one's append is
refused with error 10071, "wrong last sequence: N", and that writer has lost the stream
(:class:`StreamLost`). No timeout decides who writes a stream; the store does.

Live readers get a batch only after the store accepted it, on ``tp.live.<owner>.<id>``
(:func:`~tokenpipe.subjects.live_subject`), so what they see is what a replay reads.

A live copy is at most once, and one written to a server that dies before passing it on is lost
with no sign to its readers: a lost middle batch shows as a hole when the next one arrives, but a
lost last batch left the stream quiet until the readers' idle resync (30 s). So
:class:`LiveCopies` sends, after a reconnect, the last live copy of every stream written recently
again (readers drop duplicates by ``seq``; an app's own copy of its tokens, which stores the live
copies, drops them by ``Nats-Msg-Id`` within its duplicate window of up to 120 s).

nats-server checks the expected sequence before ``Nats-Msg-Id`` deduplication: a retry of an
append whose PubAck was lost (a reconnect, a leader change) is refused like a second writer's.
:func:`stored_as` tells the two apart: the append succeeded if the message stored last on the
subject, at the sequence the refusal names, carries this writer's ``Nats-Msg-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.js.errors import NotFoundError

from .bus import Bus
from .errors import TokenpipeError, TransportError
from .streams import batches_between
from .subjects import TOKENS_STREAM, live_subject, token_subject
from .wire import TokenBatch

__all__ = ["EXPECTED_LAST", "JUNK_SKIPS", "LiveCopies", "StreamLost", "WRONG_LAST_SEQUENCE", "append_once",
           "conditional", "in_process", "junk_since", "last_stored_as", "refused_at", "send_live", "stored_as"]

log = logging.getLogger(__name__)

EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's JSStreamWrongLastSequenceErrF
# JSStreamWrongLastSequenceConstantErr, "wrong last sequence" with no number: a clustered stream's leader
# answers it while another conditional append to the same subject is still being replicated.
WRONG_LAST_IN_PROCESS = 10164
_IN_PROCESS_WAIT_S = 0.05
# 100 x 50 ms: an append still in process after that waits for a quorum; its error goes to the caller
_IN_PROCESS_TRIES = 100
_LAST_RE = re.compile(r"(\d+)\s*$")
_LOOK_TRIES = 5  # a direct get answered by a replica that is behind the leader is asked again
# How often one append goes on after junk stored on its subject (junk_since) before the writer
# gives the stream up: each time costs the attacker one message, the writer one read.
JUNK_SKIPS = 32
# A stream's last live copy is sent again after a reconnect if it went out this recently: as long
# as a quiet reader waits before it reads the store anyway (relay.fanout's resync), so a copy lost
# on a connection that took long to be declared dead (a frozen server: ~6 s of missed pings) counts.
_LIVE_RESEND_S = 30.0
_LIVE_RESEND_MAX = 4096  # streams remembered (the newest); beyond that the readers' resync covers


class StreamLost(TokenpipeError):
    """The store refused an append: another writer appended to the stream since this writer's
    last batch. This writer no longer holds the stream and must stop writing it."""

    code = "stream_lost"

    def __init__(self, message: str, *, stored_last: int) -> None:
        super().__init__(message)
        self.stored_last = stored_last


def refused_at(exc: BaseException) -> int | None:
    """The subject's stored last sequence when ``exc`` is JetStream's wrong-last-sequence refusal
    (error 10071), else None."""
    if not isinstance(exc, nats.js.errors.APIError) or exc.err_code != WRONG_LAST_SEQUENCE:
        return None
    found = _LAST_RE.search(exc.description or "")
    return int(found.group(1)) if found else 0


def in_process(exc: BaseException) -> bool:
    """Whether ``exc`` says that another conditional append to the subject is still being stored
    (error 10164, a clustered stream's leader): no verdict on this one. Its outcome decides, so the
    append is made again (then stored, or refused with the subject's last sequence), never given up:
    taken as a refusal, a resumed stream's writer dropped its batch while the stream's previous
    holder had one in flight, and went on as if it had never been written."""
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST_IN_PROCESS


def conditional(headers: Mapping[str, str], expected_last: int) -> dict[str, str]:
    """``headers`` with the condition that the subject's last stored sequence is ``expected_last``."""
    return {**headers, EXPECTED_LAST: str(expected_last)}


async def send_live(bus: Bus, owner: str, stream_id: str, data: bytes, headers: Mapping[str, str]) -> None:
    """The live copy of a batch the store accepted (core NATS, at most once: readers fill what
    they miss from the store). Without the condition, which belongs to the store alone (an app's
    own copy of its tokens stores the live copies, and would check it against its own sequences)."""
    live = {k: v for k, v in headers.items() if k != EXPECTED_LAST}
    await bus.nc.publish(live_subject(owner, stream_id), data, headers=live or None)


@dataclass(frozen=True, slots=True)
class _LiveCopy:
    data: bytes
    headers: Mapping[str, str]
    sent: float  # loop time


class LiveCopies:
    """One process's live copies: each sent at once, the newest per stream kept a while and sent
    again after every reconnect of ``bus`` (see the module docstring). :meth:`start` in the loop."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._recent: OrderedDict[tuple[str, str], _LiveCopy] = OrderedDict()  # (owner, id) -> its last copy
        self._resends: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.bus.on_possible_loss.append(self._on_possible_loss)

    async def close(self) -> None:
        if self._on_possible_loss in self.bus.on_possible_loss:
            self.bus.on_possible_loss.remove(self._on_possible_loss)
        for task in self._resends:
            task.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)

    async def send(self, owner: str, stream_id: str, data: bytes, headers: Mapping[str, str]) -> None:
        """The live copy of a batch the store accepted, remembered first (a send that fails here
        is one lost: the next reconnect sends it again)."""
        now = asyncio.get_running_loop().time()
        recent = self._recent
        recent[owner, stream_id] = _LiveCopy(data, headers, now)
        recent.move_to_end((owner, stream_id))
        while recent and (len(recent) > _LIVE_RESEND_MAX or next(iter(recent.values())).sent < now - _LIVE_RESEND_S):
            recent.popitem(last=False)
        await send_live(self.bus, owner, stream_id, data, headers)

    def _on_possible_loss(self, sub: Any) -> None:
        if sub is None and self._recent:  # None: the connection came back (a subscription: its overflow)
            task = asyncio.get_running_loop().create_task(self._resend(), name="live-resend")
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

    async def _resend(self) -> None:
        since = asyncio.get_running_loop().time() - _LIVE_RESEND_S
        copies = [(key, c) for key, c in self._recent.items() if c.sent >= since]
        for (owner, stream_id), copy in copies:
            try:
                await send_live(self.bus, owner, stream_id, copy.data, copy.headers)
            except Exception as exc:  # disconnected again: the next reconnect sends them once more
                log.warning("live copies not sent again", extra={"error": repr(exc), "streams": len(copies)})
                return
        log.info("live copies sent again after a reconnect", extra={"streams": len(copies)})


async def stored_as(bus: Bus, subject: str, last: int, msg_id: str) -> bool:
    """Whether the message stored last on ``subject``, at stream sequence ``last``, is the one
    with ``msg_id`` (an earlier try of this very append). Asked by direct get, which any replica
    answers: one that is behind the leader is asked again, a few times."""
    for attempt in range(_LOOK_TRIES):
        try:
            raw = await bus.js.get_last_msg(TOKENS_STREAM, subject, direct=True)
        except NotFoundError:
            return False
        except Exception as exc:
            raise TransportError(f"could not read the stream's last batch: {exc}") from exc
        if raw.seq is not None and raw.seq >= last:
            return raw.seq == last and (raw.headers or {}).get("Nats-Msg-Id") == msg_id
        await asyncio.sleep(0.05 * (attempt + 1))  # a replica behind the leader: it catches up in ms
    return False


async def last_stored_as(bus: Bus, subject: str, msg_id: str) -> int:
    """The stream sequence of the message stored last on ``subject`` if it is the one with ``msg_id``,
    else 0 (not stored, not yet, another message after it, or a replica behind: the caller asks
    again later). For a PubAck that says "duplicate" without a sequence."""
    try:
        raw = await bus.js.get_last_msg(TOKENS_STREAM, subject, direct=True)
    except NotFoundError:
        return 0
    except Exception as exc:
        raise TransportError(f"could not read the stream's last batch: {exc}") from exc
    return int(raw.seq or 0) if (raw.headers or {}).get("Nats-Msg-Id") == msg_id else 0


async def junk_since(bus: Bus, owner: str, stream_id: str, after: int, upto: int) -> bool:
    """Whether everything stored on the stream's subject after sequence ``after`` up to ``upto`` (where
    a refusal says the subject's last is) is junk, no batch of the stream: an append refused because of
    it goes on after it. Inside tokenpipe's account the server sends its own answers (a PubAck, a
    direct get of a registry value, any JetStream reply) to whatever reply subject a client names,
    without permission checks: the relay's credential could have them stored on ``tp.tok.alice.<id>``
    before or during alice's stream, and each refused the generator's append (her stream stalled
    until a redelivery, and three of them ended it with an error). A batch of the stream there
    (another writer's) is no junk: the append is then lost, as before. False when it cannot be read."""
    try:
        return await batches_between(bus, stream_id, after, upto, owner=owner) == 0
    except TokenpipeError as exc:
        log.warning("cannot read what refused an append", extra={"request_id": stream_id, "error": exc.message})
        return False


async def append_once(bus: Bus, owner: str, batch: TokenBatch, *, expected_last: int,
                      headers: Mapping[str, str] | None = None, live: LiveCopies | None = None) -> int:
    """Append ``batch`` outside a writer (an error batch the intake ends a request with): stored
    only if the stream's last stored sequence is ``expected_last``, then sent live (through
    ``live`` when given, so a reconnect sends it again). Returns its stream sequence; raises
    :class:`StreamLost` when refused, the JetStream error otherwise."""
    subject = token_subject(owner, batch.id)
    hdrs = {**(headers or {}), "Nats-Msg-Id": f"{owner}:{batch.id}:{batch.seq}:intake"}
    data = batch.encode()
    skips = waits = 0
    while skips <= JUNK_SKIPS:
        try:
            ack = await bus.js.publish(subject, data, headers=conditional(hdrs, expected_last))
        except nats.js.errors.APIError as exc:
            if in_process(exc) and waits < _IN_PROCESS_TRIES:
                waits += 1
                await asyncio.sleep(_IN_PROCESS_WAIT_S)
                continue
            last = refused_at(exc)
            if last is None:
                raise
            if await stored_as(bus, subject, last, hdrs["Nats-Msg-Id"]):
                ack_seq = last
                break
            if not await junk_since(bus, owner, batch.id, expected_last, last):
                raise StreamLost(f"stream {batch.id} was appended to by another writer", stored_last=last) from exc
            log.warning("appending after junk stored on a stream's subject", extra={"request_id": batch.id,
                                                                                     "owner": owner})
            skips += 1
            expected_last = last
        else:
            ack_seq = ack.seq
            break
    else:
        raise StreamLost(f"stream {batch.id}: junk keeps being stored on its subject", stored_last=expected_last)
    if live is not None:
        await live.send(owner, batch.id, data, hdrs)
    else:
        await send_live(bus, owner, batch.id, data, hdrs)
    return ack_seq
