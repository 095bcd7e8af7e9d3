"""A dead generator's requests move on before ack_wait (generator.service.rescue; issue 48, takeover).

Real nats-server, real JetStream consumer with a 30 s ack_wait: a delivery that comes back within
seconds came back because a survivor handed it back, not because ack_wait ran out.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js import api as js_api

from generator.service.rescue import Rescuer, stream_sequence
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe.wire import Held

from .conftest import wait_until

ACK_WAIT_S = 30.0


def test_held_round_trips_and_ignores_unknown_keys() -> None:
    held = Held(worker="w-1", model="m", acks=("$JS.ACK.S.c.1.7.7.1.0",))
    assert Held.decode(held.encode()) == held
    assert Held.decode(b'{"v":1,"worker":"w","model":"m","new":1}').acks == ()


def test_stream_sequence_reads_both_ack_subject_forms() -> None:
    assert stream_sequence("$JS.ACK.TP_REQUESTS.gen-m.1.42.3.1796524125432963049.0") == 42
    assert stream_sequence("$JS.ACK.dom.ACCHASH.TP_REQUESTS.gen-m.2.43.9.1796524125432963049.0.tok") == 43
    assert stream_sequence("_INBOX.x.y") is None
    assert stream_sequence("$JS.ACK.S.c.1.notanumber.3.1.0") is None


@pytest.fixture
async def queue(bus: Bus) -> AsyncIterator[str]:
    """A work queue like TP_REQUESTS', with an ack_wait no test outlives."""
    stream = f"RESCUE_{time.monotonic_ns()}"
    await bus.js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    await bus.js.add_consumer(stream, js_api.ConsumerConfig(
        durable_name="gen", ack_policy=js_api.AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=3))
    yield stream
    await bus.js.delete_stream(stream)


async def take(b: Bus, stream: str, n: int = 1, timeout: float = 5.0) -> list[Msg]:
    sub = await b.js.pull_subscribe_bind("gen", stream)
    try:
        return await sub.fetch(n, timeout=timeout)
    finally:
        await sub.unsubscribe()


def rescuer(b: Bus, settings: Settings, name: str, held: list[Msg]) -> Rescuer:
    return Rescuer(b, settings.replace(ack_wait_s=ACK_WAIT_S), worker_id=name, model="m",
                   held=lambda: held, progress_every=1.0)


async def test_a_dead_peers_request_is_handed_back_long_before_ack_wait(
        settings: Settings, bus: Bus, queue: str) -> None:
    await bus.js.publish(f"{queue.lower()}.a", b"job")
    dying, survivor = await connect(settings, name="dying"), await connect(settings, name="survivor")
    held = await take(dying, queue)
    dead, alive = rescuer(dying, settings, "w-dead", held), rescuer(survivor, settings, "w-live", [])
    await alive.start()
    await dead.start()
    try:
        await wait_until(lambda: "w-dead" in alive.said_heard and bool(alive.peers["w-dead"].acks), 10,
                         "the survivor to hear what its peer holds (and say so)")
        gone = time.monotonic()
        await dying.nc.close()  # its connection is gone, as on kill -9: the server drops its subscriptions
        again = await take(survivor, queue, timeout=ACK_WAIT_S / 2)
        assert again[0].metadata.num_delivered == 2 and again[0].data == b"job"
        assert time.monotonic() - gone < ACK_WAIT_S / 2  # redelivered by the hand-back, not by ack_wait
        assert alive.handed_back == 1
        await again[0].ack()
    finally:
        await alive.stop()
        await dead.stop()
        await survivor.close()


async def test_a_connected_peer_that_says_nothing_keeps_its_requests(
        settings: Settings, bus: Bus, queue: str) -> None:
    """A frozen worker (SIGSTOP, a long GC) is still connected: its probe times out, it is not gone."""
    await bus.js.publish(f"{queue.lower()}.a", b"job")
    quiet, watcher = await connect(settings, name="quiet"), await connect(settings, name="watcher")
    held = await take(quiet, queue)
    peer, alive = rescuer(quiet, settings, "w-quiet", held), rescuer(watcher, settings, "w-watch", [])
    await alive.start()
    await peer.start()
    probes: list[Any] = []
    try:
        await wait_until(lambda: "w-quiet" in alive.peers, 10, "the watcher to hear its peer")
        first = alive.peers["w-quiet"].alive
        # Each probe that times out renews the peer's sign of life; several must have run.
        await wait_until(lambda: alive.peers["w-quiet"].alive > first + 3 * settings.peer_check_interval_s, 20,
                         "several alive probes to time out")
        probes.append(alive.peers["w-quiet"].gone_since)
        assert probes == [None] and alive.handed_back == 0
        info = await bus.js.consumer_info(queue, "gen")
        assert info.num_ack_pending == 1 and info.num_redelivered == 0
    finally:
        await alive.stop()
        await peer.stop()
        await watcher.close()
        await quiet.close()


async def test_only_the_lowest_live_worker_hands_a_dead_peer_back(settings: Settings, bus: Bus, queue: str) -> None:
    """Regression guard: a NAK of a delivery already handed on takes it from its new holder (the
    server does not check which delivery a NAK names), so two survivors must not both hand back."""
    await bus.js.publish(f"{queue.lower()}.a", b"job")
    dying = await connect(settings, name="dying")
    others = [await connect(settings, name=f"s{i}") for i in range(2)]
    held = await take(dying, queue)
    dead = rescuer(dying, settings, "w-b-dead", held)
    lives = [rescuer(b, settings, name, []) for b, name in zip(others, ("w-a", "w-c"), strict=True)]
    for r in lives:
        await r.start()
    await dead.start()
    try:
        def everyone_knows() -> bool:  # each survivor said it heard the dead one, and heard the other say so
            return all("w-b-dead" in r.said_heard and len(r.peers) == 2 for r in lives) and all(
                "w-b-dead" in p.knows for r in lives for w, p in r.peers.items() if w != "w-b-dead")

        await wait_until(everyone_knows, 10, "every survivor to hear every peer")
        await dying.nc.close()
        await wait_until(lambda: all(r.peers["w-b-dead"].gone_since is not None and not r.peers["w-b-dead"].acks
                                     for r in lives), 10, "both to see the peer gone")
        assert [r.handed_back for r in lives] == [1, 0]
        again = await take(others[0], queue)
        assert again[0].metadata.num_delivered == 2
    finally:
        for r in [*lives, dead]:
            await r.stop()
        for b in others:
            await b.close()


async def test_a_worker_that_came_up_after_the_death_is_not_left_to_hand_it_back(
        settings: Settings, bus: Bus, queue: str) -> None:
    """Regression: the killed generator's replacement had the lowest worker id; the survivor left
    the hand-back to it, which had never heard what the dead one held, so it waited out ack_wait."""
    await bus.js.publish(f"{queue.lower()}.a", b"job")
    dying, survivor, late = [await connect(settings, name=n) for n in ("dying", "survivor", "late")]
    held = await take(dying, queue)
    dead, old = rescuer(dying, settings, "w-m-dead", held), rescuer(survivor, settings, "w-z", [])
    await old.start()
    await dead.start()
    newcomer = rescuer(late, settings, "w-a-new", [])
    try:
        await wait_until(lambda: "w-m-dead" in old.said_heard and bool(old.peers["w-m-dead"].acks), 10,
                         "the survivor to hear what the dead one holds")
        await dying.nc.close()
        await newcomer.start()  # it hears the survivor, never the dead one
        again = await take(survivor, queue, timeout=ACK_WAIT_S / 2)
        assert again[0].metadata.num_delivered == 2
        assert (old.handed_back, newcomer.handed_back) == (1, 0)
        assert "w-m-dead" not in newcomer.said_heard
    finally:
        for r in (old, dead, newcomer):
            await r.stop()
        await survivor.close()
        await late.close()
