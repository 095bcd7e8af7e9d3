"""The generator's half of placement: its summary, and the pulls of the placement slots.

A generator records the hashed start of each request it starts (tokenpipe.placement) and publishes
what it holds and how loaded it is on ``tp.gen.place.<model>.<worker>``; submitters place requests
whose start it holds onto its slot. It hears its peers' summaries too: while one of them has idle
capacity, it pulls its own slot only for the requests it can start now, and the rest go to them.

Pulls (tokenpipe.slots): the slot's holder keeps a pull of priority 0 open on its slot's consumer;
every generator with room keeps a pull of priority 1 open on each other slot's consumer. JetStream
serves the waiting pull of the lowest priority first, so a request placed here comes here while
this generator pulls, and to a peer with room at once while it does not (its slots full, or it is
gone: "no waiting for one generator"). Nothing is polled: each pull waits at the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenpipe.background import pause, stop_loops
from tokenpipe.bus import Bus, patiently
from tokenpipe.placement import KeyRecord, PlacementTable, follow_summaries, prefix_keys, recorded_keys, session_key
from tokenpipe.settings import Settings
from tokenpipe.slots import PRIORITY_GROUP, ensure_slot_consumers
from tokenpipe.subjects import PLACE_PREFIX, REQUESTS_STREAM, slot_consumer_name
from tokenpipe.wire import PlacementSummary, Request

__all__ = ["SlotPulls", "Summary", "slot_for"]

log = logging.getLogger(__name__)

_PULL_EXPIRES_S = 2.0  # how long one pull waits at the server before it is renewed
# A pull cannot be taken back: the holder's own, opened for the slots it had free, would still take a
# request placed here after those slots filled (from the shared queue), while a peer sat idle. So
# while it pulls only for what it can start, its pull lasts this long at most.
_OWN_EXPIRES_S = 0.25
_RENEW_AHEAD_S = 0.1  # its own pull is renewed this long before it ends
_LOST_STATUS_S = 1.0  # a pull whose end was not said (a reconnect lost its status) is forgotten after this
_SUMMARY_EVERY_S = 0.1  # at most this often a changed summary goes out
_OWN, _PEER = 0, 1  # pull priorities: the holder's first


def slot_for(settings: Settings, hostname: str) -> int:
    """This generator's placement slot: ``TOKENPIPE_PLACEMENT_SLOT``, else the number a StatefulSet's pod
    name ends with (``gen-3``), else -1 (none); -1 also when it is beyond ``placement_slots``."""
    slot = settings.placement_slot
    if slot < 0:
        tail = hostname.rsplit("-", 1)[-1]
        slot = int(tail) if "-" in hostname and tail.isdigit() else -1
    return slot if 0 <= slot < settings.placement_slots else -1


class Summary:
    """The keys this generator recorded and its load, published on change and every announce interval."""

    def __init__(self, bus: Bus, settings: Settings, *, worker_id: str, model: str, slot: int,
                 load: Callable[[], tuple[int, int]]) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = worker_id
        self.model = model
        self.slot = slot
        self.load = load  # (running, waiting) now
        self.keys = KeyRecord()
        self.peers = PlacementTable()  # every generator of the model, this one included
        self._sent: tuple[int, tuple[int, int]] | None = None
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    def record(self, request: Request, owner: str) -> None:
        """Note ``request``'s start (published by ``owner``) as held here."""
        keys = recorded_keys(prefix_keys(request, owner))
        session = session_key(request, owner)
        self.keys.add([*keys, *([session] if session else [])])
        self._changed.set()

    def changed(self) -> None:
        self._changed.set()

    def summary(self, ready: bool = True) -> PlacementSummary:
        running, waiting = self.load()
        return PlacementSummary(worker=self.worker_id, model=self.model, slot=self.slot, keys=self.keys.keys(),
                                running=running, waiting=waiting, max_batch=self.settings.max_batch, ready=ready,
                                ttl_s=self.settings.announce_interval_s * 3)

    async def start(self) -> None:
        self._sub = await follow_summaries(self.bus.nc, self.peers, self.model)
        self._task = asyncio.create_task(self._run(), name="placement-summary")

    async def stop(self) -> None:
        await stop_loops(self._stopping, [self._task] if self._task else [])
        try:
            await self._publish(ready=False)  # submitters forget it at once
        except Exception as exc:  # the connection is going away: its summaries lapse with their ttl
            log.debug("cannot withdraw the placement summary", extra={"error": repr(exc)})
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _publish(self, ready: bool = True) -> None:
        await self.bus.nc.publish(f"{PLACE_PREFIX}.{self.model}.{self.worker_id}", self.summary(ready).encode())

    async def _run(self) -> None:
        last = 0.0
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=self.settings.announce_interval_s)
            except TimeoutError:
                self._sent = None  # the periodic round: sent whatever it holds
            self._changed.clear()
            if not await pause(self._stopping, max(0.0, last + _SUMMARY_EVERY_S - time.monotonic())):
                return
            state = (self.keys.version, self.load())
            if state == self._sent:
                continue
            try:
                await self._publish()
                self._sent, last = state, time.monotonic()
            except Exception as exc:  # an outage must not end the summaries for good
                log.warning("placement summary failed", extra={"error": repr(exc)})


@dataclass(slots=True)
class _Pull:
    slot: int
    deadline: float  # monotonic; past it the server has given it up
    left: int  # deliveries it may still bring

    def open(self, now: float, ahead: float = 0.0) -> bool:
        """Still open ``ahead`` seconds from ``now``."""
        return self.left > 0 and self.deadline - ahead > now


class SlotPulls:
    """The open pulls on the slot consumers of one model: this generator's own and its peers'."""

    def __init__(self, bus: Bus, settings: Settings, *, model: str, slot: int,
                 room: Callable[[], int], wanted_own: Callable[[], int],
                 deliver: Callable[[list[Msg]], Coroutine[Any, Any, None]]) -> None:
        self.bus = bus
        self.settings = settings
        self.model = model
        self.slot = slot
        self.room = room  # requests it can start now: peers' slots are pulled only while > 0
        self.wanted_own = wanted_own  # requests to pull from its own slot now
        self.deliver = deliver
        self._pulls: dict[int, _Pull] = {}  # by the number in its reply subject
        self._numbers = itertools.count()
        self._inbox = ""
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._delivering: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.settings.placement_slots <= 0:
            return
        if self.bus.provisions and not self.settings.models:  # an open bus: nobody else makes them
            # A cluster that just formed may time out the first asks (a CI run's generator exited on one).
            await patiently(lambda: ensure_slot_consumers(self.bus.nc, self.settings, [self.model]),
                            "the placement slots' consumers")
        self._inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        self._task = asyncio.create_task(self._run(), name="slot-pulls")

    async def stop(self) -> None:
        """No more pulls: the reply subject goes at once, so the server drops the pulls still open there
        (it serves a pull only while someone listens on its reply subject). Without that, a stopping
        generator's open pulls took requests it could only hand back, each return costing one of the
        request's few delivery attempts. What was already on its way is handed straight back."""
        self._stopping.set()
        self._wake.set()
        await stop_loops(self._stopping, [self._task] if self._task else [])
        await self.close()

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()

    @property
    def pulling_own(self) -> bool:
        """Whether a pull of its own slot may still be open at the server."""
        # Until the server says it ended (its status), or well past its end: the server's clock for
        # it started when the pull arrived there, after ours.
        now = time.monotonic()
        return any(p.slot == self.slot and p.left > 0 and p.deadline + _LOST_STATUS_S > now
                   for p in self._pulls.values())

    def wake(self) -> None:
        """Room changed: open the pulls it allows now."""
        self._wake.set()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                await self._open_pulls()
            except Exception as exc:  # a reconnect in progress: the next round opens them
                log.warning("slot pull failed", extra={"error": repr(exc)})
            # Renewals are due before the pulls end (its own: before the last one ends, so that one is
            # always open, else a peer's would take what was placed here in between).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._next_round())

    def _next_round(self) -> float:
        now = time.monotonic()
        due = [p.deadline - _RENEW_AHEAD_S - now for p in self._pulls.values() if p.slot == self.slot and p.left > 0]
        return min([0.25, *(d for d in due if d > 0)]) + 0.001  # one due now was renewed (or is not wanted)

    async def _open_pulls(self) -> None:
        now = time.monotonic()
        for n in [n for n, p in self._pulls.items() if p.left <= 0 or p.deadline + _LOST_STATUS_S < now]:
            del self._pulls[n]  # filled, or its end's status was lost (a reconnect)
        room = self.room()
        for slot in range(self.settings.placement_slots):
            own = slot == self.slot
            want = self.wanted_own() if own else min(room, 1)
            if want <= 0 or any(p.slot == slot and p.open(now, _RENEW_AHEAD_S if own else 0.0)
                                for p in self._pulls.values()):
                continue
            expires = _OWN_EXPIRES_S if own and want <= room else _PULL_EXPIRES_S
            number = next(self._numbers)
            self._pulls[number] = _Pull(slot, now + expires, want)
            body = {"batch": want, "expires": int(expires * 1e9), "group": PRIORITY_GROUP,
                    "priority": _OWN if own else _PEER}
            await self.bus.nc.publish(f"{self.bus.js._prefix}.CONSUMER.MSG.NEXT.{REQUESTS_STREAM}."
                                      f"{slot_consumer_name(self.model, slot)}", json.dumps(body).encode(),
                                      reply=f"{self._inbox}.{number}")

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply:  # a status, on the pull's reply subject: it ended (408 expired, 409 given up)
            self._pulls.pop(int(msg.subject.rsplit(".", 1)[-1]), None)
            self._wake.set()  # renewed now
            return
        # A delivery keeps its own subject; its consumer (place-<model>-<k>) names the slot, and the
        # oldest open pull of that slot is the one the server fills first.
        slot = int(msg.metadata.consumer.rsplit("-", 1)[-1])
        pull = next((p for p in self._pulls.values() if p.slot == slot and p.left > 0), None)
        if pull is not None:
            pull.left -= 1
            if pull.left <= 0:
                self._wake.set()  # filled: the next one now, not at the next round
        if self._stopping.is_set():
            await msg.nak()  # pulled while stopping: straight back to the others
            return
        task = asyncio.get_running_loop().create_task(self.deliver([msg]), name="slot-delivery")
        self._delivering.add(task)
        task.add_done_callback(self._delivering.discard)
