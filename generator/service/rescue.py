"""A dead generator's requests move on at once, on the NATS server's word that it is gone.

JetStream redelivers a request whose holder stopped acknowledging progress only after
``ack_wait`` (4 s): that long, plus a resume, a kill -9 stalled every stream the worker held. The
server knows sooner: a dead worker's connection closes, and its subscriptions go with it. So each
generator subscribes to ``tp.gen.alive.<worker>`` and never answers there; a request to that
subject times out while the worker is connected and gets "no responders" once it is gone.

Each generator publishes the ack subjects of the deliveries it holds (:class:`~tokenpipe.wire.Held`,
on ``tp.gen.held.<model>.<worker>``) when they change and every progress interval, and probes the
peers that hold something every ``peer_check_interval_s``. A peer gone for ``peer_gone_after_s``
(a client moving to another NATS node is back within it) has its deliveries handed back (NAK) by
one survivor, the lowest worker id among those alive: JetStream gives them to whoever pulls next,
which continues each stream from what is stored. A wrong verdict is safe: the single-writer rule
lets only one writer append to a stream.

The server does not check which delivery a NAK names: a NAK of a delivery already redelivered
takes it from its new holder and spends one of its attempts. So a survivor hands back only while
the peer's deliveries cannot have timed out yet (within ``ack_wait`` minus the progress interval
of the peer's last sign of life), and never one it holds itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from tokenpipe.background import pause, stop_loops
from tokenpipe.bus import Bus
from tokenpipe.errors import WireFormatError
from tokenpipe.settings import Settings
from tokenpipe.subjects import ALIVE_PREFIX, HELD_PREFIX
from tokenpipe.wire import Held

__all__ = ["Rescuer", "stream_sequence"]

log = logging.getLogger(__name__)

_MIN_GAP_S = 0.02  # between two publications of the held set: a burst of takes goes out as one


def stream_sequence(ack_subject: str) -> int | None:
    """The request's sequence in its stream, from a delivery's ack subject (None: not one).
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`` (9 tokens), or with the domain and
    account hash after ``ACK`` (11 or 12: nats-server 2.9's form)."""
    tokens = ack_subject.split(".")
    at = 5 if len(tokens) == 9 else 7 if len(tokens) in (11, 12) else None
    if at is None or tokens[:2] != ["$JS", "ACK"] or not tokens[at].isdigit():
        return None
    return int(tokens[at])


@dataclass
class _Peer:
    acks: tuple[str, ...] = ()
    alive: float = 0.0  # its last sign of life (a held set heard, a probe that timed out), monotonic
    knows: tuple[str, ...] = ()  # the workers it said it has heard
    gone_since: float | None = None  # the first "no responders" of the current run of them


class Rescuer:
    """Publishes what this worker holds; hands back what a dead peer of the same model held.

    ``held`` returns the deliveries this worker holds now (read, never changed); call
    :meth:`changed` when that set changes.
    """

    def __init__(self, bus: Bus, settings: Settings, *, worker_id: str, model: str,
                 held: Callable[[], Collection[Msg]], progress_every: float) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = worker_id
        self.model = model
        self.held = held
        self.progress_every = progress_every
        self.peers: dict[str, _Peer] = {}
        self.handed_back = 0  # deliveries of dead peers this worker handed back
        self.said_heard: frozenset[str] = frozenset()  # the peers named in our last published held set
        self._dirty = asyncio.Event()
        self._closing = asyncio.Event()
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def enabled(self) -> bool:
        return self.settings.peer_gone_after_s >= 0

    async def start(self) -> None:
        nc = self.bus.nc
        self._subs = [await nc.subscribe(f"{ALIVE_PREFIX}.{self.worker_id}", cb=_unanswered),
                      await nc.subscribe(f"{HELD_PREFIX}.{self.model}.*", cb=self._on_held)]
        self._tasks = [asyncio.create_task(self._publish_loop(), name="held")]
        if self.enabled:
            self._tasks.append(asyncio.create_task(self._watch_loop(), name="peers"))

    def changed(self) -> None:
        """The held set changed: publish it soon."""
        self._dirty.set()

    async def stop(self) -> None:
        """Stop watching; tell the peers this worker leaves (it hands its requests back itself)."""
        await stop_loops(self._closing, self._tasks)
        with contextlib.suppress(Exception):  # best effort: a peer that missed it probes and finds us gone
            await self._publish(leaving=True)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # -- what this worker holds ---------------------------------------------------------
    async def arrived(self, msgs: Collection[Msg]) -> None:
        """Deliveries just fetched, before they are taken: published at once with what is held.
        A request delivered to a worker that died before it published it is unknown to the peers
        and waits out ack_wait; the time between a delivery and its publication is that window."""
        try:
            await self._publish(extra=msgs)
        except Exception as exc:  # a reconnect in progress: the loop publishes it again
            log.debug("held set not published", extra={"error": repr(exc)})

    async def _publish(self, *, leaving: bool = False, extra: Collection[Msg] = ()) -> None:
        acks = () if leaving else tuple(m.reply for m in (*self.held(), *extra) if m.reply)
        peers = tuple(sorted(self.peers))
        held = Held(worker=self.worker_id, model=self.model, acks=acks, peers=peers, leaving=leaving)
        await self.bus.nc.publish(f"{HELD_PREFIX}.{self.model}.{self.worker_id}", held.encode())
        self.said_heard = frozenset(peers)

    async def _publish_loop(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self.progress_every)
            self._dirty.clear()
            try:
                await self._publish()
            except Exception as exc:  # a reconnect in progress: the next round publishes it again
                log.debug("held set not published", extra={"error": repr(exc)})
            await pause(self._closing, _MIN_GAP_S)

    # -- the peers ---------------------------------------------------------------------
    async def _on_held(self, msg: Msg) -> None:
        try:
            held = Held.decode(msg.data)
        except WireFormatError as exc:
            log.warning("held set dropped", extra={"subject": msg.subject, "error": exc.message})
            return
        if held.worker == self.worker_id or held.model != self.model:
            return
        if held.leaving:
            self.peers.pop(held.worker, None)
            return
        if held.worker not in self.peers:
            self.changed()  # our peers are part of what we publish
        peer = self.peers.setdefault(held.worker, _Peer())
        peer.acks, peer.knows, peer.alive, peer.gone_since = held.acks, held.peers, time.monotonic(), None

    async def _watch_loop(self) -> None:
        while await pause(self._closing, self.settings.peer_check_interval_s):
            holding = [(w, p) for w, p in self.peers.items() if p.acks]
            if holding:
                await asyncio.gather(*(self._probe(w, p) for w, p in holding))
            self._forget_silent()

    async def _probe(self, worker: str, peer: _Peer) -> None:
        timeout = max(min(self.settings.peer_check_interval_s, 0.2), 0.02)
        try:
            await self.bus.nc.request(f"{ALIVE_PREFIX}.{worker}", b"", timeout=timeout)
        except TimeoutError:  # subscribed, so connected: alive (it never answers)
            peer.alive, peer.gone_since = time.monotonic(), None
            return
        except NoRespondersError:
            now = time.monotonic()
            if peer.gone_since is None:
                peer.gone_since = now
            if now - peer.gone_since >= self.settings.peer_gone_after_s:
                await self._hand_on(worker, peer)
            return
        except Exception as exc:  # our own connection is down: no verdict about the peer
            log.debug("peer probe failed", extra={"peer": worker, "error": repr(exc)})
            return
        log.warning("a peer answered its alive probe", extra={"peer": worker})  # never: nobody answers there

    def _rescuer(self, dead: str, now: float) -> str | None:
        """Who hands ``dead``'s requests back: the lowest worker id among the live ones whose
        published held set said they had heard it, this one judged by what it published too, so
        that every survivor, hearing the same held sets, picks the same one (None: nobody knew it;
        ack_wait moves them). A worker that came up after the death never heard what the dead one
        held: picking it left the requests to ack_wait (the killed generator's replacement)."""
        recent = max(3 * self.progress_every, 1.0)
        knew = [w for w, p in self.peers.items()
                if p.gone_since is None and now - p.alive < recent and dead in p.knows]
        if dead in self.said_heard:
            knew.append(self.worker_id)
        return min(knew, default=None)

    async def _hand_on(self, worker: str, peer: _Peer) -> None:
        now = time.monotonic()
        acks_held, peer.acks = peer.acks, ()  # kept as a peer we heard (published) until forgotten
        if self._rescuer(worker, now) != self.worker_id:
            return
        if now - peer.alive >= self.settings.ack_wait_s - self.progress_every:
            # Its deliveries may have timed out and gone to another worker: a NAK would take them away.
            log.info("a dead peer's requests left to ack_wait", extra={"peer": worker, "count": len(acks_held)})
            return
        mine = {stream_sequence(m.reply) for m in self.held() if m.reply}
        acks = [a for a in acks_held if stream_sequence(a) not in mine]
        for ack in acks:
            await self.bus.nc.publish(ack, b"-NAK")
        await self.bus.nc.flush()
        self.handed_back += len(acks)
        log.warning("handed back a dead peer's requests", extra={
            "peer": worker, "count": len(acks), "gone_for_s": round(now - peer.alive, 3)})

    def _forget_silent(self) -> None:
        """Peers unheard for long and holding nothing (stopped without a word, or long gone)."""
        now = time.monotonic()
        horizon = 10 * max(self.progress_every, self.settings.peer_check_interval_s)
        for worker in [w for w, p in self.peers.items() if not p.acks and now - p.alive > horizon]:
            del self.peers[worker]


async def _unanswered(msg: Msg) -> None:
    """The alive subject is never answered: a subscription is all a probe needs to see."""
