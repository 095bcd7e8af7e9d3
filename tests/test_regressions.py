"""Regression tests, each named after the bug it pins (found in review)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import httpx
import pytest

from generator.engine.detok import IncrementalDetokenizer, StopMatcher
from generator.engine.handle import Emission, Job
from generator.engine.runner import Runner, torch_thread
from generator.model.loader import LoadedModel, load_model
from generator.service.worker import GeneratorWorker
from producer import aiter_sse
from relay.registry import GeneratorRegistry
from tokenpipe.bus import Bus
from tokenpipe.errors import WireFormatError
from tokenpipe.settings import Settings
from tokenpipe.streams import Gap, cancel, follow, history
from tokenpipe.subjects import cancel_subject, token_subject
from tokenpipe.wire import Cancel, Request, StreamMeta, TokenBatch, new_request_id

from .conftest import RelayServer, start_relay, wait_until


async def store(bus: Bus, sid: str, seqs: list[int], final: int) -> None:
    """Put batches of one token each into TP_TOKENS in the given (possibly shuffled) order."""
    for seq in seqs:
        batch = TokenBatch(id=sid, seq=seq, index=seq, token_ids=(100 + seq,), text=f"<{seq}>",
                           finish="length" if seq == final else None)
        await bus.js.publish(token_subject(bus.owner, sid), batch.encode())


async def test_follow_returns_batches_stored_out_of_order_instead_of_calling_them_expired(bus: Bus) -> None:
    sid = new_request_id()
    await store(bus, sid, [1, 0, 2], final=2)
    got = [b async for b in follow(bus, sid)]
    assert [b.seq for b in got if isinstance(b, TokenBatch)] == [0, 1, 2]
    assert not [g for g in got if isinstance(g, Gap)]
    sid2 = new_request_id()
    await store(bus, sid2, [0, 1, 2, 4, 3, 5], final=5)
    resumed = [b async for b in follow(bus, sid2, after_seq=2)]
    assert [b.seq for b in resumed if isinstance(b, TokenBatch)] == [3, 4, 5]


async def test_history_orders_by_seq_not_by_storage(bus: Bus) -> None:
    sid = new_request_id()
    await store(bus, sid, [0, 1, 2, 4, 5, 3], final=99)
    assert [b.seq for b in await history(bus, sid)] == [0, 1, 2, 3, 4, 5]
    sid2 = new_request_id()
    await store(bus, sid2, [0, 1, 3], final=99)  # 2 never stored: continuation must restart at 2
    assert [b.seq for b in await history(bus, sid2)] == [0, 1]


def test_resume_rebuilds_detokenizer_and_stop_state(tiny_model: LoadedModel) -> None:
    """Text held back at a crash (stop-string prefix, partial character) is neither lost nor repeated."""

    def run(job: Job) -> tuple[str, str | None, list[int]]:
        done = threading.Event()
        out: list[Emission] = []

        def on_emit(ems: list[Emission]) -> None:
            out.extend(ems)
            if any(e.finish for e in ems):
                done.set()

        runner = Runner(tiny_model, on_emit, max_batch=2)
        runner.start()
        runner.submit(job)
        assert done.wait(60)
        runner.stop()
        return "".join(e.text for e in out), out[-1].finish, [t for e in out for t in e.token_ids]

    base = {"v": 1, "id": "r", "model": "tiny-random", "prompt": "The river"}
    full_text, _, _ = run(Job(Request.from_map({**base, "params": {"max_tokens": 40, "temperature": 0,
                                                                       "ignore_eos": True}})))
    stop = full_text[12:16]
    stopped_text, finish, stopped_ids = run(Job(Request.from_map(
        {**base, "params": {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}})))
    assert finish == "stop" and stopped_text == full_text[: full_text.index(stop)]
    tok = tiny_model.tokenizer
    for cut in range(1, len(stopped_ids)):
        # what the first worker published before dying at token `cut`, then the continuation
        published = []
        detok, matcher = IncrementalDetokenizer(tok, tok.encode(base["prompt"])), StopMatcher([stop])
        for t in stopped_ids[:cut]:
            published.append(matcher.feed(detok.push(t))[0])
        req = Request.from_map({**base, "params": {"max_tokens": 40, "temperature": 0, "ignore_eos": True,
                                                   "stop": [stop]}})
        rest, finish2, _ = run(Job(req, resume_ids=tuple(stopped_ids[:cut])))
        assert "".join(published) + rest == stopped_text, cut
        assert finish2 == "stop"


async def test_last_event_id_with_unicode_digit_is_400_not_500(http: httpx.AsyncClient) -> None:
    sid = (await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})).json()["id"]
    for bad in ("²".encode(), b"--5", b"-5", b"1e3"):
        r = await http.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": bad})
        assert r.status_code == 400, bad
    assert (await http.get(f"/v1/streams/{sid}", params={"last_event_id": "-3"})).status_code == 400


async def test_token_id_beyond_int32_is_400_not_503(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json={"input_ids": [1, 2**64], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
    r = await http.post("/v1/completions", json={"model": "tiny-random", "prompt": [2**40], "max_tokens": 2})
    assert r.status_code == 400


async def test_regression_stream_refused_503_after_a_stalled_event_loop(relay: RelayServer) -> None:
    """CI failure: a synchronous test blocked the shared event loop past the announcements' TTL and
    the next POST got 503 at once although the generator was alive. A lapsed model is now asked
    for directly (discovery) and given a moment before the relay answers 503."""
    for info in relay.app.state.relay.registry.workers.values():
        info.expires = time.monotonic() - 0.01  # as if the last announcement's TTL just ran out
    async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
        r = await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 201, r.text


def test_only_a_recently_lapsed_generator_is_waited_for() -> None:
    registry = GeneratorRegistry()
    registry.update(b'{"worker": "w1", "model": "m", "ttl_s": 1.0}', now=100.0)
    assert len(registry.live(now=100.5)) == 1 and not registry.recently_lapsed("m", 30.0, now=100.5)
    assert registry.live(now=101.5) == []
    assert registry.recently_lapsed("m", 30.0, now=101.5)  # expired at 101.0: maybe only late
    assert not registry.recently_lapsed("m", 30.0, now=131.5)  # long gone: refuse at once
    assert not registry.recently_lapsed("never-served", 30.0, now=101.5)


@pytest.fixture
async def limited(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[RelayServer]:
    relay = await start_relay(settings.replace(max_streams_per_key=2))
    yield relay
    await relay.stop()


async def test_unread_streams_count_against_the_key_limit(limited: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=limited.url, timeout=30) as http:
        long = {"prompt": "x", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        ids = [(await http.post("/v1/streams", json=long)).json()["id"] for _ in range(2)]
        third = await http.post("/v1/streams", json=long)
        assert third.status_code == 429
        await http.delete(f"/v1/streams/{ids[0]}")  # the owner's cancel frees its slot
        assert (await http.post("/v1/streams", json={"prompt": "y", "max_tokens": 2})).status_code == 201
        await http.delete(f"/v1/streams/{ids[1]}")
        # concurrent creations cannot slip past the limit together (the short stream above may have
        # finished meanwhile, unread: then it no longer counts, issue 25, and two fit)
        results = await asyncio.gather(*(http.post("/v1/streams", json=long) for _ in range(6)))
        created = [r.json()["id"] for r in results if r.status_code == 201]
        assert 1 <= len(created) <= 2 and all(r.status_code in (201, 429) for r in results)
        for sid in created:
            await http.delete(f"/v1/streams/{sid}")


async def test_blocking_completion_is_cancelled_when_the_client_hangs_up(relay: RelayServer, bus: Bus,
                                                                         generator: GeneratorWorker) -> None:
    body = {"model": "tiny-random", "prompt": "never waited for", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}
    await wait_until(lambda: not generator.active, 30, "earlier requests to finish")
    async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
        call = asyncio.create_task(http.post("/v1/completions", json=body))
        # Hang up as soon as the generation runs (not after a fixed delay, which a fast machine
        # could outlast): cancelling the call closes the connection.
        await wait_until(lambda: bool(generator.active), 20, "the completion to start")
        (held,) = generator.active.values()  # keyed by owner and id
        rid = held.request.id
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    final = [b async for b in follow(bus, rid) if isinstance(b, TokenBatch) and b.is_final]
    assert final[0].finish == "cancelled"
    assert final[0].usage is not None and final[0].usage.completion_tokens < 2000


def test_regression_engine_steps_on_the_thread_that_loaded_the_model(data_dir: Path) -> None:
    """Steps on a second torch thread ran 1.5x slower (OpenMP keeps a team per thread): the
    generator now loads the model, allocates the KV cache and steps on one ``torch_thread``."""
    pool = torch_thread()
    try:
        loader_thread = pool.submit(threading.get_ident).result()
        loaded = pool.submit(partial(load_model, "tiny-random", device="cpu", dtype="float32",
                                     data_dir=data_dir)).result()
        steps_on: set[int] = set()
        done = threading.Event()

        def on_emit(ems: list[Emission]) -> None:
            steps_on.add(threading.get_ident())
            if any(e.finish for e in ems):
                done.set()

        runner = Runner(loaded, on_emit, max_batch=2, torch_thread=pool)
        runner.start()
        runner.submit(Job(Request.from_map({"v": 1, "id": "t", "model": "tiny-random", "prompt": "hi",
                                            "params": {"max_tokens": 5, "ignore_eos": True}})))
        assert done.wait(60)
        runner.stop()
        assert steps_on == {loader_thread}
    finally:
        pool.shutdown()


def test_burst_handed_over_one_by_one_is_prefilled_together(tiny_model: LoadedModel) -> None:
    """A burst used to be prefilled in waves (the first job alone, the rest a prefill later):
    jobs flagged ``more_coming`` make an idle engine wait for the rest of their burst."""
    prefills: list[set[str]] = []  # per engine step: the requests whose first token it produced
    finished: set[str] = set()
    done = threading.Event()

    def on_emit(ems: list[Emission]) -> None:
        firsts = {e.request_id for e in ems if e.admitted_ns}
        if firsts:
            prefills.append(firsts)
        finished.update(e.request_id for e in ems if e.finish)
        if sum(map(len, prefills)) == 3:
            done.set()

    def until(cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)  # polling what the engine thread records

    runner = Runner(tiny_model, on_emit, max_batch=4, admission_hold_s=5.0)
    runner.start()
    try:
        def job(rid: str, more: bool) -> Job:
            return Job(Request.from_map({"v": 1, "id": rid, "model": "tiny-random", "prompt": f"burst {rid}",
                                         "params": {"max_tokens": 3, "ignore_eos": True}}), more_coming=more)

        runner.submit(job("a", True))
        runner.submit(job("b", True))
        assert not done.wait(0.3)  # held: the burst is not complete yet
        runner.submit(job("c", False))
        assert done.wait(60)
        assert prefills == [{"a", "b", "c"}]  # one prefill for all three
        # A hold that ran out must not keep later bursts from being held (it once did).
        runner.admission_hold_s = 0.2
        runner.submit(job("d", True))  # no "last of the burst" comes: d's hold runs out, d runs alone
        until(lambda: "d" in finished, "d to run alone and finish")  # the engine is idle again
        runner.admission_hold_s = 30.0  # e's hold outlasts any stall of this thread
        runner.submit(job("e", True))
        time.sleep(0.1)  # the scenario, not a synchronisation: f comes a little after e, inside e's hold
        runner.submit(job("f", False))
        until(lambda: sum(map(len, prefills)) == 6, "e and f to start")
        assert prefills[1:] == [{"d"}, {"e", "f"}]
    finally:
        runner.stop()


async def test_malformed_or_misdirected_cancels_cancel_nothing_and_are_counted(
        http: httpx.AsyncClient, bus: Bus, generator: GeneratorWorker) -> None:
    """Issue 24: whatever lands on ``tp.cancel.<owner>.<id>`` that is no cancel of that stream by that
    owner (an empty message, a server's PubAck error provoked there with a forged reply subject, a
    cancel naming another stream or owner) is dropped and counted; a real cancel still cancels."""
    metrics = generator.metrics
    model = metrics.model

    def dropped() -> float:
        return metrics.registry.get_sample_value("tokenpipe_dropped_cancels_total", {"model_name": model}) or 0.0

    before = dropped()
    body = {"prompt": "do not stop me", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    created = await http.post("/v1/streams", json=body)
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    subject = cancel_subject(bus.owner, sid)
    junk = [b"", b'{"error":{"code":503,"description":"expected stream does not match"}}',
            Cancel(new_request_id(), bus.owner).encode(), Cancel(sid, "mallory").encode(), b"\xc1\x00"]
    for data in junk:
        await bus.nc.publish(subject, data)
    await wait_until(lambda: dropped() - before >= len(junk), 30, "the generator to drop the junk cancels")
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        events = [(e.event, e.data) async for e in aiter_sse(resp)]
    assert events[-1][0] == "done" and json.loads(events[-1][1])["finish"] == "length", events[-1]
    assert dropped() - before == len(junk)

    victim = await http.post("/v1/streams", json={**body, "max_tokens": 4000, "coalesce": {"max_tokens": 1}})
    vid = victim.json()["id"]
    await cancel(bus, vid)  # the well-formed cancel, as the relay and the SDK send it
    async with http.stream("GET", f"/v1/streams/{vid}") as resp:
        events = [(e.event, e.data) async for e in aiter_sse(resp)]
    assert json.loads(events[-1][1])["finish"] == "cancelled"
    assert dropped() - before == len(junk)


async def test_junk_stored_over_a_stream_record_is_rebuilt_for_its_owner_instead_of_a_400(
        settings: Settings, bus: Bus, generator: GeneratorWorker) -> None:
    """Issue 24: a JetStream answer provoked onto ``$KV.tp_streams.<id>`` (reply injection) made the
    owner's GET a 400 "stream meta: bad field" for good. The record is rebuilt from the tenant's
    index entry, for the owner only: another tenant still gets the plain 404."""
    keys = settings.replace(api_keys="key-alice:alice,key-bob:bob")
    first, second = await start_relay(keys), await start_relay(keys)  # the second has no cached record
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=60,
                                     headers={"Authorization": "Bearer key-alice"}) as alice:
            created = await alice.post("/v1/streams", json={"prompt": "keep me", "max_tokens": 5, "temperature": 0,
                                                             "ignore_eos": True})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            async with alice.stream("GET", f"/v1/streams/{sid}") as resp:
                live = [(e.event, e.data) async for e in aiter_sse(resp)]
        assert live[-1][0] == "done"
        await bus.meta.put(sid, b'{"type":"io.nats.jetstream.api.v1.account_info_response","memory":0}')

        async with httpx.AsyncClient(base_url=second.url, timeout=60) as http:
            bob = await http.get(f"/v1/streams/{sid}", headers={"Authorization": "Bearer key-bob"})
            assert bob.status_code == 404 and bob.json()["error"]["code"] == "stream_not_found", bob.text
            with pytest.raises(WireFormatError):  # nothing was rebuilt for bob
                StreamMeta.decode((await bus.meta.get(sid)).value)
            async with http.stream("GET", f"/v1/streams/{sid}",
                                   headers={"Authorization": "Bearer key-alice"}) as resp:
                assert resp.status_code == 200
                again = [(e.event, e.data) async for e in aiter_sse(resp)]
        assert again == live
        rebuilt = StreamMeta.decode((await bus.meta.get(sid)).value)
        assert (rebuilt.id, rebuilt.tenant, rebuilt.model) == (sid, "alice", created.json()["model"])
    finally:
        await first.stop()
        await second.stop()


async def test_a_generator_whose_start_fails_lets_its_engine_thread_go(settings: Settings, bus: Bus,
                                                                       tiny_model: LoadedModel) -> None:
    """Regression (the chaos run, a cluster still forming): the request consumer's info timed out
    in GeneratorWorker.start after the engine loop was running on the torch thread, a non-daemon
    executor thread that the interpreter joins at exit. The process never exited, never became
    ready, and `tokenpipe up` never restarted it."""
    engine_thread = torch_thread()
    worker = GeneratorWorker(settings, tiny_model, bus, torch_thread=engine_thread)

    async def consumer_info_timed_out() -> None:
        raise TimeoutError("nats: timeout")

    worker.intake.subscribe = consumer_info_timed_out  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        await worker.start()
    engine_thread.shutdown(wait=False)
    assert worker.runner._running is not None and worker.runner._running.done()


async def test_a_relay_stops_when_a_jetstream_request_swallows_the_cancel_of_its_repair_loop(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's repair loop ended by cancel alone, as the generator's loops did before they hung
    a worker's ``stop`` (tokenpipe.background): a JetStream request that loses the cancel (nats-py
    awaits replies with ``asyncio.wait_for``; on 3.11 a reply landing with the cancel wins) let the
    loop go on to its next round and ``RelayState.stop`` wait for ever. Here the check swallows its
    cancel, deterministically; ``stop`` must still return."""
    import relay.state as state_module
    from relay.state import RelayState

    entered = asyncio.Event()

    async def swallowing(*args: object, **kwargs: object) -> list[str]:
        entered.set()
        try:
            await asyncio.Event().wait()  # the reply, never here before the cancel
        except asyncio.CancelledError:
            return []  # ... and the cancel lost
        return []

    monkeypatch.setattr(state_module, "REPAIR_INTERVAL_S", 0.05)
    state = RelayState(settings)
    await state.start()
    monkeypatch.setattr(state_module, "missing", swallowing)
    await asyncio.wait_for(entered.wait(), 30)
    stopping = asyncio.create_task(state.stop())
    done, _ = await asyncio.wait({stopping}, timeout=30)  # not wait_for: its own cancel would be swallowed too
    assert done, "RelayState.stop() did not return: the repair loop went on after its cancel"


async def test_announcements_lapsed_while_a_gauge_waited_on_a_leaderless_consumer(
        bus: Bus, generator: GeneratorWorker) -> None:
    """Regression: the announcement loop awaited the queue gauge's ``consumer_info`` before its
    next announcement. Under a frozen cluster node the consumer was between leaders, the call took
    seconds, both generators' announcements lapsed at every relay, and a POST got 503 "no
    generator" with both alive (test_node_frozen_for_ten_seconds in CI). Here that JetStream call
    never answers (the one fault injected); the announcements must keep their cadence."""
    released = asyncio.Event()
    asked = asyncio.Event()

    async def leaderless(*args: object, **kwargs: object) -> object:
        asked.set()
        await released.wait()
        raise TimeoutError("no consumer leader")

    seen: list[float] = []

    async def on_announcement(msg: object) -> None:
        seen.append(time.monotonic())

    sub = await bus.nc.subscribe(f"tp.gen.announce.{generator.worker_id}", cb=on_announcement)
    generator.bus.js.consumer_info = leaderless  # type: ignore[method-assign]
    try:
        await wait_until(asked.is_set, 10, "the gauge to ask JetStream")
        start = len(seen)
        await wait_until(lambda: len(seen) >= start + 4, 15, "four announcements while the gauge waits")
    finally:
        del generator.bus.js.consumer_info  # the class's method again
        released.set()
        await sub.unsubscribe()


def test_an_idle_engine_hands_the_heap_its_work_grew_back_once(tiny_model: LoadedModel,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 49, RSS): glibc kept the heap a burst's prefills grew and an idle generator's RSS
    counted it (+226 MB after three ~1,000-token chats in fp32). The engine thread hands it back once it
    has been idle a while after work (never on a request's path), and not again until it works again."""
    import generator.engine.runner as runner_mod

    trims: list[float] = []
    trimmed = threading.Event()

    def record() -> None:  # on the engine thread
        trims.append(time.monotonic())
        trimmed.set()

    monkeypatch.setattr(runner_mod, "release_freed_memory", record)
    monkeypatch.setattr(runner_mod, "IDLE_TRIM_S", 0.2)
    done = threading.Event()
    last_emit: list[float] = []

    def on_emit(ems: list[Emission]) -> None:  # on the engine thread, at the end of each step
        last_emit.append(time.monotonic())
        if any(e.finish for e in ems):
            done.set()

    runner = Runner(tiny_model, on_emit, max_batch=2)
    runner.start()
    try:
        # An absence is observed over a window: idle from the start, nothing grew, nothing is handed back.
        assert not trimmed.wait(0.5)
        runner.submit(Job(Request.from_map({"v": 1, "id": "trim", "model": "tiny-random", "prompt": "hi",
                                            "params": {"max_tokens": 5, "ignore_eos": True}})))
        assert done.wait(60)
        assert trimmed.wait(30), "the heap was never handed back after the work"
        assert trims[0] - last_emit[-1] >= 0.15  # after the idle wait, both stamped on the engine thread
        trimmed.clear()
        assert not trimmed.wait(0.6) and len(trims) == 1  # once per idle spell
    finally:
        runner.stop()
