"""One writer per stream, enforced by JetStream (tokenpipe.append, generator.service.publisher): every
append is conditional on the stream's last stored batch, a writer whose append is refused has
lost the stream, and live readers get only what the store accepted. Real nats-server."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from nats.aio.msg import Msg

from generator.service.publisher import BatchPublisher
from tokenpipe.append import StreamLost, append_once, conditional
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe.streams import history_at, stored, stored_count
from tokenpipe.subjects import RELAY_OWNER, live_subject, token_subject
from tokenpipe.wire import TokenBatch

from .conftest import wait_until


def _batch(sid: str, seq: int, token: int, *, final: bool = False) -> TokenBatch:
    return TokenBatch(id=sid, seq=seq, index=seq, token_ids=(token,), text=f"<{token}>",
                      finish="length" if final else None)


async def _live(bus: Bus, sid: str) -> tuple[list[TokenBatch], Any]:
    seen: list[TokenBatch] = []

    async def on(msg: Msg) -> None:
        seen.append(TokenBatch.decode(msg.data))

    sub = await bus.nc.subscribe(live_subject(RELAY_OWNER, sid), cb=on)
    await bus.nc.flush()
    return seen, sub


def _headers(sid: str, seq: int, tag: str) -> dict[str, str]:
    return {"Nats-Msg-Id": f"{RELAY_OWNER}:{sid}:{seq}:{tag}"}


async def test_a_second_writer_is_refused_stops_and_never_reaches_the_store_or_live_readers(bus: Bus) -> None:
    """The frozen-holder case: A wrote batch 0 and stalled, B took the request over from what is
    stored and wrote batch 1; A thaws and appends its own batch 1 — refused, A has lost the stream."""
    sid = f"sw-{secrets.token_hex(4)}"
    live, sub = await _live(bus, sid)
    a, b = BatchPublisher(bus), BatchPublisher(bus)
    await a.start()
    await b.start()
    lost_a: list[StreamLost] = []
    try:
        chain_a = a.chain(RELAY_OWNER, sid, last=0, on_lost=lost_a.append)
        a.publish(chain_a, _batch(sid, 0, 10).encode(), _headers(sid, 0, "a"))
        await a.flush()
        past, last = await history_at(bus, sid)  # B's resume path
        assert [x.seq for x in past] == [0] and last == chain_a.last > 0
        chain_b = b.chain(RELAY_OWNER, sid, last=last, on_lost=lambda exc: pytest.fail(f"B lost: {exc}"))
        b.publish(chain_b, _batch(sid, 1, 21).encode(), _headers(sid, 1, "b"))
        await b.flush()
        # A thaws: its batch 1 and its final batch 2, then its request's ack.
        a.publish(chain_a, _batch(sid, 1, 11).encode(), _headers(sid, 1, "a"))
        a.publish(chain_a, _batch(sid, 2, 12, final=True).encode(), _headers(sid, 2, "a"))
        acked: list[str] = []

        class _Msg:
            async def ack(self) -> None:
                acked.append("a")

        a.ack_after_published(chain_a, _Msg())  # type: ignore[arg-type]
        await a.flush()
        assert len(lost_a) == 1 and chain_a.lost and acked == []
        b.publish(chain_b, _batch(sid, 2, 22, final=True).encode(), _headers(sid, 2, "b"))
        await b.flush()
        by_seq = await stored(bus, sid)
        assert {s: v[0].token_ids for s, v in by_seq.items()} == {0: (10,), 1: (21,), 2: (22,)}
        await wait_until(lambda: len(live) == 3, timeout=5)
        assert [(x.seq, x.token_ids) for x in live] == [(0, (10,)), (1, (21,)), (2, (22,))]
    finally:
        await sub.unsubscribe()
        await a.close()
        await b.close()


async def test_a_retry_of_an_append_that_was_stored_after_all_is_recognised_as_its_own(bus: Bus) -> None:
    """nats-server checks the expected sequence before Msg-Id deduplication: a retry after a lost
    PubAck is refused like a second writer's. The publisher must tell its own append apart."""
    sid = f"sw-{secrets.token_hex(4)}"
    pub = BatchPublisher(bus)
    await pub.start()
    try:
        chain = pub.chain(RELAY_OWNER, sid, last=0, on_lost=lambda exc: pytest.fail(f"lost: {exc}"))
        data, headers = _batch(sid, 0, 7).encode(), _headers(sid, 0, "me")
        # The first try reached the store; its PubAck never came back.
        ack = await bus.js.publish(token_subject(RELAY_OWNER, sid), data, headers=conditional(headers, 0))
        pub.publish(chain, data, headers)
        pub.publish(chain, _batch(sid, 1, 8, final=True).encode(), _headers(sid, 1, "me"))
        await pub.flush()
        assert not chain.lost and chain.last > ack.seq
        assert [x.token_ids for x in (await history_at(bus, sid))[0]] == [(7,), (8,)]
    finally:
        await pub.close()


async def test_a_duplicate_puback_without_a_sequence_does_not_lose_the_stream(bus: Bus) -> None:
    """A chaos run's stream never ended: a retry met its own earlier try still being replicated and
    the clustered server answered "duplicate" with sequence 0; taken as stored at 0, the next append
    was refused and the writer gave the stream up with nobody left to write it. The server's answer
    to the first append is rewritten here into that form (a real store holds the batch)."""
    sid = f"sw-{secrets.token_hex(4)}"
    pub = BatchPublisher(bus)
    real = pub._acks._on_reply
    staged: list[bytes] = []

    async def first_answered_as_staged(msg: Msg) -> None:
        if not staged:
            staged.append(msg.data)
            msg.data = b'{"stream": "TP_TOKENS", "seq": 0, "duplicate": true}'
        await real(msg)

    pub._acks._on_reply = first_answered_as_staged  # type: ignore[method-assign]
    await pub.start()
    acked: list[str] = []

    class _Msg:
        subject = "tp.req.x.relay"
        headers = None

        async def ack(self) -> None:
            acked.append("acked")

    try:
        chain = pub.chain(RELAY_OWNER, sid, last=0, on_lost=lambda exc: pytest.fail(f"lost: {exc}"))
        pub.publish(chain, _batch(sid, 0, 7).encode(), _headers(sid, 0, "me"))
        pub.publish(chain, _batch(sid, 1, 8, final=True).encode(), _headers(sid, 1, "me"))
        pub.ack_after_published(chain, _Msg())  # type: ignore[arg-type]
        assert chain.key in pub.unacked  # kept by the worker's progress acks until its batches are stored
        await pub.flush()
        assert staged and not chain.lost and acked == ["acked"] and chain.key not in pub.unacked
        assert [x.token_ids for x in (await history_at(bus, sid))[0]] == [(7,), (8,)]
    finally:
        await pub.close()


async def test_an_error_batch_is_not_appended_to_a_stream_that_has_history(bus: Bus) -> None:
    sid = f"sw-{secrets.token_hex(4)}"
    await bus.js.publish(token_subject(RELAY_OWNER, sid), _batch(sid, 0, 1).encode(),
                         headers=conditional(_headers(sid, 0, "w"), 0))  # a writer's first batch
    with pytest.raises(StreamLost):
        await append_once(bus, RELAY_OWNER, TokenBatch.error_for(sid, "no", "invalid_request"), expected_last=0)
    assert [x.token_ids for x in (await history_at(bus, sid))[0]] == [(1,)]


async def test_junk_stored_on_a_streams_subject_does_not_take_it_from_its_writer(bus: Bus) -> None:
    """issue 48: whatever the server was made to store on the subject (a JetStream answer sent there as
    a reply subject; here an API answer and another stream's batch) refused the writer's next append
    and it gave the stream up. It now appends after junk; a batch of the stream there (another
    writer's) still takes the stream from it."""
    sid = f"sw-{secrets.token_hex(4)}"
    subject = token_subject(RELAY_OWNER, sid)
    pub = BatchPublisher(bus)
    await pub.start()
    lost: list[StreamLost] = []
    try:
        await bus.nc.publish("$JS.API.INFO", b"", reply=subject)  # junk first: the first append expects 0
        await bus.nc.flush()
        await wait_until(lambda: _count(bus, sid, 1), 5, "the junk in the store")
        chain = pub.chain(RELAY_OWNER, sid, last=0, on_lost=lost.append)
        pub.publish(chain, _batch(sid, 0, 10).encode(), _headers(sid, 0, "a"))
        await pub.flush()
        other = _batch("someone-else", 0, 99).encode()  # junk mid-stream: another stream's batch
        await bus.js.publish(subject, other, headers={"Nats-Msg-Id": f"{RELAY_OWNER}:someone-else:0:x"})
        pub.publish(chain, _batch(sid, 1, 11).encode(), _headers(sid, 1, "a"))
        await pub.flush()
        assert not lost and [x.token_ids for x in (await history_at(bus, sid))[0]] == [(10,), (11,)]
        # A second writer's batch 2 behind more junk: that is no junk, the stream is lost.
        await bus.js.publish(subject, _batch(sid, 2, 22).encode(), headers=_headers(sid, 2, "b"))
        await bus.nc.publish("$JS.API.INFO", b"", reply=subject)
        await bus.nc.flush()
        await wait_until(lambda: _count(bus, sid, 5), 5, "the second writer's batch and junk in the store")
        pub.publish(chain, _batch(sid, 2, 12, final=True).encode(), _headers(sid, 2, "a"))
        await pub.flush()
        assert len(lost) == 1 and chain.lost
        assert [x.token_ids for x in (await history_at(bus, sid))[0]] == [(10,), (11,), (22,)]
    finally:
        await pub.close()


async def test_an_error_batch_goes_after_junk_on_an_empty_stream(bus: Bus) -> None:
    """The intake's error batch for a refused request (the stream's first, expected last sequence 0)
    was refused by junk stored first on the subject, and its client heard nothing."""
    sid = f"sw-{secrets.token_hex(4)}"
    await bus.nc.publish("$JS.API.INFO", b"", reply=token_subject(RELAY_OWNER, sid))
    await bus.nc.flush()
    await wait_until(lambda: _count(bus, sid, 1), 5, "the junk in the store")
    await append_once(bus, RELAY_OWNER, TokenBatch.error_for(sid, "no", "invalid_request"), expected_last=0)
    assert [x.error for x in (await history_at(bus, sid))[0]] == ["no"]


async def _count(bus: Bus, sid: str, n: int) -> bool:
    return await stored_count(bus, sid) >= n


async def test_a_last_live_copy_lost_with_its_server_is_sent_again_after_a_reconnect(bus: Bus,
                                                                                     settings: Settings) -> None:
    """Regression (CI, ``kill -9`` of the TP_TOKENS leader on the 3-node cluster): a generator's live
    copy of a stream's final batch, written to the node that died, never reached the relay; with
    no later batch to show a hole, the client waited out the relay's 30 s idle resync. After a
    reconnect the publisher sends each recent stream's last live copy again, and so does the
    intake's error batch that ended a request (``append_once`` through the publisher's copies).

    The readers subscribe before anything is written and see each copy sent again as a second
    copy of its stream's last batch. (Readers that subscribed only after the first copies, to have
    missed them, lost a copy sent again 2 ms later in 1 run of ~10 on one nats-server: its match
    for the subject, cached on the writer's connection as the first copy went out, could still
    lack the new subscription.)"""
    own = await connect(settings, name="tests-resend")  # its own bus: only this publisher's hook
    pub = BatchPublisher(own)
    await pub.start()
    sid, other, refused = (f"sw-{secrets.token_hex(4)}" for _ in range(3))
    (live, sub), (live_other, sub_other), (live_refused, sub_refused) = [
        await _live(bus, s) for s in (sid, other, refused)]
    subs = [sub, sub_other, sub_refused]
    try:
        for s in (sid, other):
            chain = pub.chain(RELAY_OWNER, s, last=0, on_lost=lambda exc: pytest.fail(f"lost: {exc}"))
            pub.publish(chain, _batch(s, 0, 1).encode(), _headers(s, 0, "w"))
            pub.publish(chain, _batch(s, 1, 2, final=s == sid).encode(), _headers(s, 1, "w"))
        await pub.flush()
        await append_once(own, RELAY_OWNER, TokenBatch.error_for(refused, "no", "invalid_request"), expected_last=0,
                          live=pub.live)
        await wait_until(lambda: (len(live), len(live_other), len(live_refused)) == (2, 2, 1), timeout=10,
                         what="the first live copies")
        for hook in list(own.on_possible_loss):
            hook(None)  # what the bus does after a reconnect
        await wait_until(lambda: len(live) >= 3 and len(live_other) >= 3 and len(live_refused) >= 2, timeout=10,
                         what="the last live copies sent again")
        assert [(x.seq, x.is_final) for x in live] == [(0, False), (1, True), (1, True)]
        assert [(x.seq, x.is_final) for x in live_other] == [(0, False), (1, False), (1, False)]
        assert [(x.seq, x.finish) for x in live_refused] == [(0, "error"), (0, "error")]
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await pub.close()
        await own.close()
