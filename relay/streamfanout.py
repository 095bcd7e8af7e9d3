"""Live batches from one core subscription per stream read here (``TOKENPIPE_RELAY_FANOUT=stream``).

The shared fan-out (:class:`relay.fanout.Fanout`) holds one ``tp.tok.relay.>`` subscription, so
every relay receives every stream's batches: K relays cost K× the token traffic, and each
relay's CPU grows with the whole cluster's traffic, not with the streams it serves
(``python -m bench.relays``). Here a relay subscribes to ``tp.tok.relay.<id>`` (the owner-scoped
token subject, ``LiveStream.subject``) while it has a reader of that stream and unsubscribes
after the last one: NATS delivers a batch only to the relays that read its stream, so adding
relays adds capacity. Readers, ordering, gaps and catch-up are
the shared fan-out's (:class:`relay.fanout.LiveStream`); only where the messages come from
differs.

One difference in guarantees: a new subscription reaches the other servers of a cluster a
moment after it is made, so a reader never skips its first look at JetStream (``fresh`` is
ignored): a batch published before the interest arrived is read from JetStream instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .fanout import Fanout, LiveStream

__all__ = ["StreamFanout"]

log = logging.getLogger(__name__)


class StreamFanout(Fanout):
    """A :class:`Fanout` whose subscriptions follow its readers: one per stream read here."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._subs: dict[str, Any] = {}  # subject -> nats subscription (None while being made)
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.bus.on_possible_loss.append(self._on_possible_loss)

    async def stop(self) -> None:
        if self._on_possible_loss in self.bus.on_possible_loss:
            self.bus.on_possible_loss.remove(self._on_possible_loss)
        await asyncio.gather(*self._pending, return_exceptions=True)
        subs, self._subs = [s for s in self._subs.values() if s is not None], {}
        if not self.bus.nc.is_closed:
            for sub in subs:
                await sub.unsubscribe()

    def open(self, stream_id: str, *, after_seq: int = -1, fresh: bool = False) -> LiveStream:
        reader = super().open(stream_id, after_seq=after_seq, fresh=False)
        if reader.subject not in self._subs:
            self._subs[reader.subject] = None
            # nats-py's subscribe only queues the SUB (no round trip); as a task it still goes out
            # before anything the caller publishes next on this connection (the request).
            self._spawn(self._subscribe(reader.subject))
        return reader

    def _close(self, reader: LiveStream) -> None:
        super()._close(reader)
        if reader.subject not in self._readers and reader.subject in self._subs:
            self._spawn(self._unsubscribe(reader.subject, self._subs.pop(reader.subject)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _subscribe(self, subject: str) -> None:
        try:
            sub = await self.bus.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=1 << 16,
                                              pending_bytes_limit=64 << 20)
        except Exception as exc:  # connection closing; readers still catch up from JetStream
            log.warning("stream subscription failed", extra={"subject": subject, "error": repr(exc)})
            self._subs.pop(subject, None)
            return
        if subject in self._subs and self._subs[subject] is None:
            self._subs[subject] = sub
        else:  # the last reader left while the SUB was being made
            await self._unsubscribe(subject, sub)

    async def _unsubscribe(self, subject: str, sub: Any) -> None:
        if sub is None or self.bus.nc.is_closed:
            return
        try:
            await sub.unsubscribe()
        except Exception as exc:  # reconnecting or closing: the server drops it with the connection
            log.debug("stream unsubscribe failed", extra={"subject": subject, "error": repr(exc)})

    def _on_possible_loss(self, sub: Any) -> None:
        if sub is None or sub in self._subs.values():
            super()._on_possible_loss(None)
