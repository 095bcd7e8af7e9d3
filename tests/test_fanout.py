"""The relay's live reader: one subscription per stream read, readers in seq order, JetStream catch-up."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from relay.fanout import Fanout, LiveStream
from tokenpipe.bus import Bus
from tokenpipe.errors import TransportError
from tokenpipe.reorder import Gap
from tokenpipe.streams import StreamItem, follow
from tokenpipe.subjects import token_subject
from tokenpipe.wire import TokenBatch, new_request_id

from .conftest import RelayServer, read_sse, wait_until


def batch(sid: str, seq: int, final: bool = False) -> TokenBatch:
    return TokenBatch(id=sid, seq=seq, index=seq, token_ids=(seq,), text=f"t{seq}",
                      finish="stop" if final else None)


@pytest.fixture
async def fanout(bus: Bus) -> AsyncIterator[Fanout]:
    # A reorder wait far longer than any stall between two publishes on a busy machine: a test
    # that wants a hole declared lost opens its own fan-out with a short one.
    f = Fanout(bus, resync_s=0.5, reorder_wait=30.0)
    await f.start()
    yield f
    await f.stop()


async def publish(bus: Bus, b: TokenBatch) -> None:
    await bus.js.publish(token_subject(bus.owner, b.id), b.encode())


async def collect(reader: LiveStream, idle: float | None = None) -> list[StreamItem]:
    return [item async for item in reader.items(idle=idle)]


def seqs(items: list[StreamItem]) -> list[int]:
    return [b.seq for b in items if isinstance(b, TokenBatch)]


def loss_reported(bus: Bus) -> None:
    """What the bus does after a reconnect: every subscription may have missed messages."""
    for hook in list(bus.on_possible_loss):
        hook(None)


async def test_reader_gets_live_batches_in_seq_order_even_when_published_out_of_order(
        bus: Bus, fanout: Fanout) -> None:
    sid = new_request_id()
    reader = fanout.open(sid)
    task = asyncio.create_task(collect(reader))
    for seq in (0, 2, 1, 1, 3):  # a hole, then the missing batch, then a duplicate
        await publish(bus, batch(sid, seq, final=seq == 3))
    items = await asyncio.wait_for(task, 30)
    assert [b.seq for b in items if isinstance(b, TokenBatch)] == [0, 1, 2, 3]
    assert fanout.readers == 0


async def test_reader_opened_late_catches_up_from_jetstream_then_continues_live(bus: Bus, fanout: Fanout) -> None:
    sid = new_request_id()
    for seq in range(3):
        await publish(bus, batch(sid, seq))
    reader = fanout.open(sid, after_seq=0)  # resume: wants 1, 2, then live
    got: list[StreamItem] = []

    async def read() -> None:
        async for item in reader.items():
            got.append(item)

    task = asyncio.create_task(read())
    await wait_until(lambda: seqs(got) == [1, 2], 10, "the stored batches after the resume point")
    await publish(bus, batch(sid, 3, final=True))
    await asyncio.wait_for(task, 30)
    assert seqs(got) == [1, 2, 3]


async def test_resume_after_the_final_batch_still_reports_the_end(bus: Bus, fanout: Fanout) -> None:
    sid = new_request_id()
    for seq in range(2):
        await publish(bus, batch(sid, seq, final=seq == 1))
    items = await asyncio.wait_for(collect(fanout.open(sid, after_seq=1)), 30)
    assert len(items) == 1 and isinstance(items[0], TokenBatch)
    assert items[0].is_final and items[0].token_ids == ()


async def test_batch_that_never_arrives_becomes_an_explicit_gap(bus: Bus) -> None:
    fanout = Fanout(bus, resync_s=0.5, reorder_wait=0.5)
    await fanout.start()
    try:
        sid = new_request_id()
        reader = fanout.open(sid)
        task = asyncio.create_task(collect(reader))
        await publish(bus, batch(sid, 0))
        await publish(bus, batch(sid, 3, final=True))  # 1 and 2 are never published (nor stored)
        items = await asyncio.wait_for(task, 30)
    finally:
        await fanout.stop()
    assert [(type(i).__name__, getattr(i, "seq", None)) for i in items] == [
        ("TokenBatch", 0), ("Gap", None), ("TokenBatch", 3)]
    gap = items[1]
    assert isinstance(gap, Gap) and (gap.from_seq, gap.to_seq) == (1, 2)


class _Deaf(Fanout):
    """Loses every batch on the live path, as a disconnect would."""

    async def _on_msg(self, msg: object) -> None:
        return None


def count_looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the readers' looks at JetStream (each one starts with a direct get or a full read)."""
    import relay.fanout as fanout_module

    looks: list[str] = []
    for name in ("last_stored", "stored"):
        real = getattr(fanout_module, name)

        async def counted(b: Bus, sid: str, _real: object = real, _name: str = name) -> object:
            looks.append(_name)
            return await _real(b, sid)  # type: ignore[operator]

        monkeypatch.setattr(fanout_module, name, counted)
    return looks


@contextlib.asynccontextmanager
async def deaf_reader(bus: Bus, monkeypatch: pytest.MonkeyPatch,
                      **kw: float) -> AsyncIterator[tuple[str, asyncio.Task[list[StreamItem]]]]:
    """A reader of a new stream that hears nothing live, once its opening looks are done."""
    looks = count_looks(monkeypatch)
    fan = _Deaf(bus, settle_s=0.05, **kw)
    await fan.start()
    try:
        sid = new_request_id()
        task = asyncio.create_task(collect(fan.open(sid)))
        await wait_until(lambda: len(looks) >= 2, 10, "the opening look and the settling one")
        yield sid, task
    finally:
        await fan.stop()


async def test_final_batch_missed_by_the_live_path_is_found_by_resync(bus: Bus,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Core delivery is at-most-once: a batch stored after the reader's first looks, whose live
    copy never reached it, must still arrive."""
    async with deaf_reader(bus, monkeypatch, resync_s=0.5, reorder_wait=30.0) as (sid, task):
        await publish(bus, batch(sid, 0, final=True))
        items = await asyncio.wait_for(task, 30)
    assert [b.seq for b in items if isinstance(b, TokenBatch)] == [0]


async def test_undecodable_message_on_a_token_subject_is_skipped(bus: Bus, fanout: Fanout) -> None:
    sid = new_request_id()
    reader = fanout.open(sid)
    task = asyncio.create_task(collect(reader))
    await bus.nc.publish(token_subject(bus.owner, sid), b"\xc1 not msgpack")
    await publish(bus, batch(sid, 0, final=True))
    items = await asyncio.wait_for(task, 30)
    assert [b.seq for b in items if isinstance(b, TokenBatch)] == [0]


async def test_regression_openai_client_gone_before_reading_leaves_no_registered_reader(
        relay: RelayServer) -> None:
    """A live reader registered before submission must be unregistered even when the response
    is never read (it would otherwise sit in the dispatch table for good)."""
    fan = relay.app.state.relay.forwarder.fanout
    assert fan is not None
    before = fan.readers
    async with httpx.AsyncClient(base_url=relay.url, timeout=60) as client:
        for _ in range(5):
            async with client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "stream": True,
                    "ignore_eos": True}) as resp:
                assert resp.status_code == 200
            # leaving the block closes the connection without reading a byte
        await wait_until(lambda: fan.readers == before, 30, "readers to be unregistered")


async def test_regression_reader_that_catches_up_the_first_batch_still_gets_its_trace_context(
        bus: Bus, fanout: Fanout) -> None:
    """The first batch read back with one direct get used to come without its headers, so the
    relay's forward span lost the generation's trace whenever the client connected late."""
    sid = new_request_id()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await bus.js.publish(token_subject(bus.owner, sid), batch(sid, 0).encode(),
                         headers={"traceparent": parent})
    reader = fanout.open(sid)
    trace_headers: dict[str, str] = {}
    got: list[StreamItem] = []

    async def read() -> None:
        async for item in reader.items(trace_headers=trace_headers):
            got.append(item)

    task = asyncio.create_task(read())
    await wait_until(lambda: len(got) == 1, 10, "the stored first batch")
    await publish(bus, batch(sid, 1, final=True))
    await asyncio.wait_for(task, 30)
    assert trace_headers.get("traceparent") == parent


async def test_failed_catch_up_is_retried_and_the_stream_goes_on(bus: Bus, fanout: Fanout,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A JetStream look that fails (the server still recovering after a restart) used to end the
    client's stream, and the relay then cancelled the generation."""
    import relay.fanout as fanout_module

    real = fanout_module.last_stored
    failures = []

    async def flaky(b: Bus, sid: str) -> object:
        if not failures:
            failures.append(sid)
            raise TransportError("JetStream not ready (injected)")
        return await real(b, sid)

    monkeypatch.setattr(fanout_module, "last_stored", flaky)
    sid = new_request_id()
    await publish(bus, batch(sid, 0))
    task = asyncio.create_task(collect(fanout.open(sid)))
    await wait_until(lambda: bool(failures), 10, "the injected failure")
    await publish(bus, batch(sid, 1, final=True))
    items = await asyncio.wait_for(task, 30)
    assert [b.seq for b in items if isinstance(b, TokenBatch)] == [0, 1]


async def test_reconnect_makes_readers_look_again_without_waiting_for_the_idle_resync(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    async with deaf_reader(bus, monkeypatch, resync_s=3600, loss_spread_s=0.2) as (sid, task):
        await publish(bus, batch(sid, 0, final=True))  # its live copy never reaches the reader, as in a disconnect
        loss_reported(bus)
        items = await asyncio.wait_for(task, 10)  # not the hour-long idle resync
    assert [b.seq for b in items if isinstance(b, TokenBatch)] == [0]


async def test_forged_batch_naming_another_stream_and_junk_are_dropped_and_counted_not_shown(
        bus: Bus, http: httpx.AsyncClient) -> None:
    """A batch stored on a stream's subject that names another stream (the issue-24 forged text: a
    stored batch replayed onto ``tp.tok.relay.<id>``), or no batch at all, is dropped by every
    reader (the relay's, live and catch-up; tokenpipe.streams.follow) and counted, never shown."""
    created = await http.post("/v1/streams", json={"prompt": "forge me", "max_tokens": 30, "temperature": 0,
                                                    "ignore_eos": True, "coalesce": {"max_tokens": 1}})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    forged = TokenBatch(id=new_request_id(), seq=2, index=2, token_ids=(1,), text="MALLORY WAS HERE",
                        finish="stop")
    await bus.js.publish(token_subject(bus.owner, sid), b"\xc1 not msgpack")
    await bus.js.publish(token_subject(bus.owner, sid), forged.encode())
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        events = await read_sse(resp)
    assert "MALLORY" not in "".join(d for _, _, d in events)
    tokens = [json.loads(d) for e, _, d in events if e == "tokens"]
    assert [t["seq"] for t in tokens] == list(range(len(tokens)))
    assert events[-1][0] == "done" and json.loads(events[-1][2])["finish"] == "length"
    assert sum(len(t["token_ids"]) for t in tokens) == 30
    followed = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch)]
    assert [b.seq for b in followed] == list(range(len(followed))) and len(followed) - len(tokens) in (0, 1)
    assert all(b.id == sid for b in followed) and followed[-1].finish == "length"
    metrics = (await http.get("/metrics")).text
    for reason in ("undecodable", "wrong_stream"):
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith(f'tokenpipe_dropped_batches_total{{reason="{reason}"}}'))
        assert float(line.split()[-1]) >= 1, line
