"""Prefix-aware placement (tokenpipe.placement, tokenpipe.slots, generator.service.placed; issue 47).

Pure parts as functions; then two real generators on a real nats-server: a conversation's later
turns go to the generator that served its first, and a request placed on a generator that cannot
start it (its one slot busy, or it is gone) is taken by the other at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from generator.model.loader import load_model
from generator.service.placed import slot_for
from generator.service.worker import GeneratorWorker
from producer import Producer
from tokenpipe.bus import Bus, connect
from tokenpipe.errors import InvalidRequest
from tokenpipe.placement import CHUNK_CHARS, KeyRecord, PlacementTable, prefix_keys, recorded_keys, session_key
from tokenpipe.settings import Settings
from tokenpipe.subjects import owner_of_request, request_subject, slot_consumer_name, slot_of_request
from tokenpipe.wire import PlacementSummary, Request

from .conftest import wait_until

MODEL = "tiny-place"


def ids(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def req(input_ids: tuple[int, ...], **kw: object) -> Request:
    return Request.create(MODEL, input_ids=input_ids, **kw)  # type: ignore[arg-type]


def test_placed_subjects_name_owner_and_slot_and_nothing_else_parses() -> None:
    assert request_subject("m", "alice") == "tp.req.m.alice"
    assert request_subject("m", "alice", 3) == "tp.req.m.alice.p3"
    assert owner_of_request("tp.req.m.alice.p3") == "alice"
    assert slot_of_request("tp.req.m.alice.p3") == 3 and slot_of_request("tp.req.m.alice") is None
    for bad in ("tp.req.m.alice.x3", "tp.req.m.alice.p", "tp.req.m.alice.p3.more", "tp.req.m.alice.3"):
        with pytest.raises(InvalidRequest):
            owner_of_request(bad)
    # the last dash-separated part is the slot: model "a" slot 12 and model "a-1" slot 2 differ
    assert slot_consumer_name("a", 12) != slot_consumer_name("a-1", 2)


def test_a_later_turn_shares_the_earlier_turns_keys_and_owners_never_share_keys() -> None:
    first = prefix_keys(req(ids(300)), "relay")
    later = prefix_keys(req(ids(400)), "relay")
    assert len(first) == len(",".join(map(str, ids(300)))) // CHUNK_CHARS > 2
    assert later[:len(first)] == first and len(later) > len(first)
    assert prefix_keys(req(ids(300), tenant="bob"), "relay")[0] != first[0]  # another tenant
    assert prefix_keys(req(ids(300)), "mallory")[0] != first[0]  # another owner
    assert prefix_keys(req(ids(10)), "relay") == []  # under one chunk: nothing to place by
    rec = recorded_keys(first)
    assert rec[-1] == first[-1] and set(rec) <= set(first) and len(rec) < len(first)
    assert session_key(req(ids(3)), "relay") is None
    assert session_key(req(ids(3), session="u1"), "relay") != session_key(req(ids(3), session="u1"), "bob")


def test_key_record_is_bounded_least_recently_used_first() -> None:
    record = KeyRecord(limit=3)
    record.add(["a", "b", "c"])
    record.add(["a", "d"])
    assert record.keys() == ("c", "a", "d")


def summary(worker: str, slot: int, keys: list[str], *, running: int = 0, waiting: int = 0,
            ready: bool = True) -> PlacementSummary:
    return PlacementSummary(worker=worker, model=MODEL, slot=slot, keys=tuple(keys), running=running,
                            waiting=waiting, max_batch=4, ready=ready, ttl_s=5.0)


def test_overlap_against_load_chooses_and_a_busy_generator_is_passed_over() -> None:
    now = [0.0]
    table = PlacementTable(clock=lambda: now[0])
    turn = req(ids(600))
    keys = prefix_keys(turn, "relay")
    assert table.choose(turn, "relay") is None  # nobody announced anything: the shared queue
    table.update(summary("a", 0, recorded_keys(keys[:2])))
    table.update(summary("b", 1, recorded_keys(keys[:5]), running=1))
    choice = table.choose(turn, "relay")
    assert choice is not None and (choice.worker, choice.slot, choice.overlap, choice.reason) == ("b", 1, 5, "prefix")
    table.update(summary("b", 1, recorded_keys(keys[:5]), running=4))  # its batch full: a holds less, but is free
    choice = table.choose(turn, "relay")
    assert choice is not None and (choice.worker, choice.overlap) == ("a", 2)
    # No match anywhere: the least loaded, and a burst is spread before the summaries catch up.
    table.update(summary("b", 1, recorded_keys(keys[:5])))
    table.update(summary("a", 0, recorded_keys(keys[:2])))
    other = [req(ids(600, start=9 + i)) for i in range(4)]
    picks = [table.choose(r, "relay") for r in other]
    assert all(c is not None and c.reason == "load" for c in picks)
    assert sorted(c.worker for c in picks if c is not None) == ["a", "a", "b", "b"]
    hinted = req(ids(600, start=9), session="conv-7")
    table.update(summary("a", 0, [session_key(hinted, "relay") or ""]))
    choice = table.choose(hinted, "relay")
    assert choice is not None and (choice.worker, choice.reason) == ("a", "session")
    assert table.free_elsewhere(MODEL, "a") == 4 and table.free_elsewhere(MODEL, "b") == 4
    table.update(summary("b", 1, recorded_keys(keys[:5]), waiting=4))  # a full batch waits there
    choice = table.choose(turn, "relay")
    assert choice is not None and choice.worker == "a"
    table.update(summary("a", 0, [], waiting=4))
    assert table.choose(turn, "relay") is None  # every generator has a full batch waiting: shared queue
    assert not table.idle_elsewhere(MODEL, "a")  # a burst is no longer split with b
    table.update(summary("b", 1, recorded_keys(keys[:5]), ready=False))  # leaving: forgotten at once
    assert all(s.worker != "b" for s in table.live(MODEL))
    now[0] = 10.0  # past every ttl
    assert table.live(MODEL) == [] and table.choose(hinted, "relay") is None


def test_the_slot_comes_from_the_setting_else_a_statefulset_ordinal(settings: Settings) -> None:
    assert slot_for(settings.replace(placement_slot=2), "vm") == 2
    assert slot_for(settings, "tokenpipe-generator-3") == 3
    assert slot_for(settings, "vm") == -1
    assert slot_for(settings.replace(placement_slot=9), "vm") == -1  # beyond placement_slots (8)
    assert slot_for(settings.replace(placement_slots=0, placement_slot=0), "vm") == -1


# -- two real generators -------------------------------------------------------------------------

def placed(worker: GeneratorWorker, how: str) -> float:
    return worker.metrics.registry.get_sample_value(
        "tokenpipe_placed_requests_total", {"model_name": MODEL, "how": how}) or 0.0


@pytest.fixture(params=[2])
async def pair(request: pytest.FixtureRequest, settings: Settings,
               data_dir: Path) -> AsyncIterator[list[GeneratorWorker]]:
    """Generators on slots 0 and 1 of their own model, ``param`` engine slots each."""
    workers, buses = [], []
    for slot in (0, 1):
        loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
        loaded.name = MODEL
        bus = await connect(settings, name=f"place-generator-{slot}", role="generator")
        buses.append(bus)
        workers.append(GeneratorWorker(settings.replace(max_batch=request.param, placement_slot=slot, waiting_room=0),
                                       loaded, bus))
    for w in workers:
        await w.start()
    yield workers
    for w, b in zip(workers, buses, strict=True):
        await w.stop(drain_timeout=1.0)
        await b.close()


async def test_a_conversations_later_turns_go_to_the_generator_that_served_its_first(
        pair: list[GeneratorWorker], settings: Settings) -> None:
    async with await Producer.connect(settings=settings.replace(app_name="chat")) as app:
        table = app.bus.placement
        assert table is not None
        history = ids(300, start=5)
        first = await app.submit(MODEL, input_ids=history, max_tokens=4, temperature=0, ignore_eos=True)
        await asyncio.wait_for(first.result(), 60)  # placed by load (or shared, before any summary)
        served = next(w for w in pair if placed(w, "shared") + placed(w, "own") + placed(w, "taken") == 1)
        base = placed(served, "own")
        other = next(w for w in pair if w is not served)
        turn = req(history)
        await wait_until(lambda: (c := table.choose(turn, "chat")) is not None and c.worker == served.worker_id,
                         10, "the first turn's generator to announce its start")
        for n in range(3):  # each turn resends the history and adds to it
            history = history + ids(120, start=1000 + 200 * n)
            handle = await app.submit(MODEL, input_ids=history, max_tokens=4, temperature=0, ignore_eos=True)
            assert (await asyncio.wait_for(handle.result(), 60)).finish == "length"
        assert placed(served, "own") - base == 3 and placed(other, "own") + placed(other, "taken") == 0
        assert served.runner.stats().prefix_hit_tokens > 0


@pytest.mark.parametrize("pair", [1], indirect=True)  # one slot: one long request fills it
async def test_a_request_placed_on_a_busy_or_gone_generator_is_taken_by_the_other_at_once(
        pair: list[GeneratorWorker], settings: Settings) -> None:
    busy, free = pair
    bus: Bus = await connect(settings, name="place-submitter")
    try:
        async with await Producer.connect(settings=settings.replace(app_name="place")) as app:
            # Generator 0's one slot runs a long request...
            long = await app.submit(MODEL, input_ids=ids(20), max_tokens=400, temperature=0, ignore_eos=True)
            await wait_until(lambda: busy.runner.running == 1 or free.runner.running == 1, 30, "the long one running")
            holder = busy if busy.runner.running == 1 else free
            idle = free if holder is busy else busy
            # (a pull its free slot had opened lapses within a quarter second; it does not renew it full)
            await wait_until(lambda: not holder.slot_pulls.pulling_own, 10, "the holder's own pull to lapse")
            # ... and a request placed on its slot: the idle one takes it, long before the long one ends.
            quick = Request.create(MODEL, input_ids=ids(30, start=40), tenant="default")
            quick = Request.from_map({**quick.to_map(), "params": {"max_tokens": 3, "ignore_eos": True}})
            await app.bus.js.publish(request_subject(MODEL, "place", holder.summary.slot), quick.encode())
            result = await asyncio.wait_for(app.stream(quick.id).result(), 60)
            assert result.finish == "length" and placed(idle, "taken") == 1
            assert holder.runner.running == 1  # the long one still runs: nobody waited for it
            await app.cancel(long.id)
            # A slot nobody holds (its generator gone): taken at once too.
            gone = Request.from_map({**Request.create(MODEL, input_ids=ids(30, start=90)).to_map(),
                                     "params": {"max_tokens": 2, "ignore_eos": True}})
            await app.bus.js.publish(request_subject(MODEL, "place", 5), gone.encode())
            assert (await asyncio.wait_for(app.stream(gone.id).result(), 60)).finish == "length"
            assert placed(busy, "taken") + placed(free, "taken") == 2
    finally:
        await bus.close()
