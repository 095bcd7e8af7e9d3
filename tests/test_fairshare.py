"""Fair share between owners and quotas per owner (issue 46, parts 2 and 3): within a class of
service a generator's slots go to owners in proportion to their weights, whoever queued first;
an owner past its quota is refused naming it and when to retry."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator.engine.scheduler import Engine, Sequence
from generator.model.kvcache import BLOCK_SIZE
from generator.model.loader import LoadedModel, load_model
from generator.service.worker import GeneratorWorker
from producer import Producer
from tokenpipe.bus import connect as connect_bus
from tokenpipe.errors import RateLimited
from tokenpipe.quota import TokenRate, request_cost
from tokenpipe.settings import Settings
from tokenpipe.streams import history_at
from tokenpipe_cli.natsserver import NatsServer

from .conftest import engine_held_after, start_relay, wait_until
from .test_lanes import alone, params, prompt_of


def flood(engine: Engine, owner: str, n: int, *, tokens: int = 40, weight: float = 1.0, batch: bool = False,
          start: int = 0) -> list[Sequence]:
    seqs = [engine.new_sequence(f"{owner}{i}", prompt_of(start + i, 9), params(tokens, None), owner=owner,
                                weight=weight, batch=batch) for i in range(n)]
    for seq in seqs:
        engine.add(seq)
    return seqs


def test_a_lone_request_behind_another_owners_backlog_preempts_its_youngest_row_at_once(
        tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=4, max_seq_len=128)
    backlog = flood(engine, "flood", 6, tokens=12)
    engine.step()
    assert [s.owner for s in engine.rows] == ["flood"] * 4
    other = flood(engine, "other", 1, tokens=5, start=50)[0]
    engine.step()
    assert other in engine.rows and engine.preemptions == 1
    assert backlog[3] not in engine.rows and engine.waiting[0] is backlog[3]  # the youngest made way, first again
    engine.run_to_completion()
    for seq in (*backlog, other):
        assert seq.generated == alone(tiny_model, seq.prompt, seq.params), seq.id


def test_two_backlogged_owners_share_the_slots_by_weight_and_never_trade_one_back(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=6, max_seq_len=128)
    flood(engine, "alice", 20, weight=2.0)  # queued first: FIFO would give her every slot
    engine.step()
    flood(engine, "bob", 20, start=40)
    tokens = {"alice": 0, "bob": 0}
    preempted = engine.preemptions
    for step in range(30):
        outputs = engine.step()
        if step >= 3:  # the shares settled
            for out in outputs:
                if out.token is not None:
                    tokens[out.seq.owner] += 1
            running = sorted(s.owner for s in engine.rows)
            assert running.count("alice") == 4 and running.count("bob") == 2, running
        if step == 3:
            preempted = engine.preemptions
    assert engine.preemptions == preempted  # settled: no slot moves back and forth
    assert tokens["alice"] == 2 * tokens["bob"], tokens


def test_interactive_work_still_goes_before_batch_work_of_an_owner_under_its_share(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=2, max_seq_len=128)
    flood(engine, "alice", 4)
    flood(engine, "bob", 2, batch=True, start=10)
    engine.step()
    assert sorted(s.owner for s in engine.rows) == ["alice", "alice"]  # bob's flex work waits, unfair or not
    assert [s.batch for s in engine.waiting] == [False, False, True, True]


def test_owner_max_running_caps_an_owner_and_lends_the_slot_to_others(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=4, max_seq_len=128, owner_max_running=2)
    flood(engine, "alice", 5)
    engine.step()
    assert [s.owner for s in engine.rows] == ["alice", "alice"]  # two slots left idle: her cap
    flood(engine, "bob", 5, start=20)
    engine.step()
    assert sorted(s.owner for s in engine.rows) == ["alice", "alice", "bob", "bob"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.lists(st.tuples(st.integers(0, 10), st.sampled_from(["a", "b", "c"]), st.booleans(),
                                             st.integers(1, 2 * BLOCK_SIZE), st.integers(1, 16),
                                             st.none() | st.integers(0, 2**31)), min_size=2, max_size=7))
def test_tokens_identical_however_fair_share_preempts(
        tiny_model: LoadedModel, slots: int, reqs: list[tuple[int, str, bool, int, int, int | None]]) -> None:
    """Owners a (weight 2), b and c arriving at random steps, in both classes: every request's tokens
    are those of its run alone, however often fair share preempted it."""
    engine = Engine(tiny_model, max_batch=slots, max_seq_len=128)
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    seqs: list[Sequence] = []
    step = 0
    while step <= 10 or not engine.idle:
        for i, (at, owner, batch, length, n, seed) in enumerate(reqs):
            if at == step:
                seqs.append(engine.new_sequence(f"r{i}", prompt_of(i, length), params(n, seed), owner=owner,
                                                weight=weights[owner], batch=batch))
                engine.add(seqs[-1])
        engine.step()
        step += 1
    for seq in seqs:
        assert seq.generated == alone(tiny_model, seq.prompt, seq.params), (seq.id, engine.preemptions)
    assert engine.pool.used == 0


# -- the quota's arithmetic --------------------------------------------------------------------------

def test_token_rate_refuses_past_the_quota_naming_it_and_when_it_fits_again() -> None:
    now = [1000.0]
    rate = TokenRate(100, clock=lambda: now[0])
    rate.charge("alice", 60)
    now[0] += 20
    rate.charge("alice", 30)
    rate.charge("bob", 100)  # another owner's minute is its own
    with pytest.raises(RateLimited) as refused:
        rate.charge("alice", 20)
    assert refused.value.retry_after == 40 and refused.value.code == "rate_limit_exceeded"
    assert "TOKENPIPE_OWNER_TOKENS_PER_MIN" in refused.value.message and "retry after 40 s" in refused.value.message
    now[0] += 40  # the first charge has left the window
    rate.charge("alice", 20)
    assert rate.spent("alice") == 50
    now[0] += 100
    rate.charge("alice", 500)  # more than the whole quota, but nothing spent: let through once
    assert request_cost(10, 9) == 13


# -- on the bus ----------------------------------------------------------------------------------------

def gauge(worker: GeneratorWorker, name: str, owner: str) -> float:
    value = worker.metrics.registry.get_sample_value(name, {"model_name": worker.model, "owner": owner})
    return value or 0.0


async def test_another_apps_request_behind_one_apps_backlog_on_the_bus_finishes_before_the_backlog(
        settings: Settings, data_dir: Path, tmp_path: Path) -> None:
    """Two slots; one app queues 8 long requests, then another app one short one, all before the
    generator runs (one FIFO). The generator holds them in its waiting room, the other app's request
    takes a slot from the backlog at once: its last batch is stored before any of the backlog's. The
    per-owner gauges show the backlog waiting and running meanwhile, and zero once all is done."""
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-fair"
    server = NatsServer(tmp_path / "nats")  # its own: the backlog is queued before any generator runs
    server.start()
    settings = settings.replace(nats_url=server.url)
    bus = await connect_bus(settings, name="fair-generator")
    worker = GeneratorWorker(settings.replace(max_batch=2, progress_interval_s=0.1), loaded, bus)
    backlog = 8
    assert backlog + 1 <= 2 + worker.settings.waiting_room
    try:
        async with await Producer.connect(settings=settings.replace(app_name="flood")) as flood, \
                await Producer.connect(settings=settings.replace(app_name="other")) as other:
            handles = [await flood.submit("tiny-fair", input_ids=prompt_of(i, 12), max_tokens=120, temperature=0,
                                          ignore_eos=True) for i in range(backlog)]
            p = params(6, None)
            mine = await other.submit("tiny-fair", input_ids=prompt_of(99, 12), max_tokens=6, temperature=0,
                                      ignore_eos=True)
            await worker.start()
            await wait_until(lambda: gauge(worker, "tokenpipe_num_requests_running_per_owner", "flood") >= 1
                             and gauge(worker, "tokenpipe_num_requests_waiting_per_owner", "flood") >= 4,
                             60, "the backlog running and waiting in the gauges")
            results = await asyncio.wait_for(asyncio.gather(mine.result(), *(h.result() for h in handles)), 300)
            assert results[0].token_ids == alone(loaded, prompt_of(99, 12), p)
            mine_last = (await history_at(other.bus, mine.id))[1]
            backlog_last = [(await history_at(flood.bus, h.id))[1] for h in handles]
            assert mine_last < min(backlog_last), (mine_last, backlog_last)
            assert worker.runner.stats().preemptions >= 1 or results[1].finish == "length"
            await wait_until(lambda: all(gauge(worker, f"tokenpipe_num_requests_{kind}_per_owner", owner) == 0
                                         for kind in ("running", "waiting") for owner in ("flood", "other")),
                             10, "the gauges back at zero")
    finally:
        await worker.stop(drain_timeout=1.0)
        await bus.close()
        server.stop()


async def test_a_tenants_stream_behind_another_tenants_backlog_at_the_relay_finishes_before_it(
        settings: Settings, data_dir: Path, generator: GeneratorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind the relay the owner is the tenant (every HTTP request is the relay's on the bus): bob's
    stream created after alice's six on a two-slot generator is stored complete before any of hers.
    The engine is held after its first steps until bob's request is waiting (a CI-like busy run: tiny-random's
    150 tokens of alice's two running streams were done before bob's request reached the generator)."""
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-tenants"
    bus = await connect_bus(settings, name="tenants-generator")
    worker = GeneratorWorker(settings.replace(max_batch=2, progress_interval_s=0.1), loaded, bus)
    await worker.start()
    relay = await start_relay(settings.replace(api_keys="key-alice:alice,key-bob:bob"),
                              ready_headers={"Authorization": "Bearer key-alice"})
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=60) as http:
            body = {"model": "tiny-tenants", "temperature": 0, "ignore_eos": True}
            alice = {"Authorization": "Bearer key-alice"}
            hers = []
            with engine_held_after(worker, 3, monkeypatch) as release:
                for i in range(6):
                    r = await http.post("/v1/streams", headers=alice,
                                        json={**body, "prompt": f"job {i}", "max_tokens": 150})
                    assert r.status_code == 201, r.text
                    hers.append(r.json()["id"])
                await wait_until(lambda: gauge(worker, "tokenpipe_num_requests_waiting_per_owner", "alice") >= 1,
                                 30, "alice's backlog waiting, by tenant")
                r = await http.post("/v1/streams", headers={"Authorization": "Bearer key-bob"},
                                    json={**body, "prompt": "mine", "max_tokens": 5})
                his = r.json()["id"]
                # At the generator, waiting or already running: where the engine had steps left when it came,
                # fair share admitted it at once, preempting one of alice's rows (a run here waited 30 s for
                # "waiting" while bob's request ran).
                await wait_until(lambda: gauge(worker, "tokenpipe_num_requests_waiting_per_owner", "bob")
                                 + gauge(worker, "tokenpipe_num_requests_running_per_owner", "bob") >= 1,
                                 30, "bob's request at the generator")
                release.set()
            read = await http.get(f"/v1/streams/{his}", headers={"Authorization": "Bearer key-bob"})  # to its end
            assert "event: done" in read.text, read.text
            his_last = (await history_at(bus, his))[1]
            for sid in hers:  # read to their end: stored after his
                await http.get(f"/v1/streams/{sid}", headers=alice)
            hers_last = [(await history_at(bus, sid))[1] for sid in hers]
            assert his_last < min(hers_last), (his_last, hers_last)
    finally:
        await relay.stop()
        await worker.stop(drain_timeout=1.0)
        await bus.close()


def generated(worker: GeneratorWorker) -> float:
    return worker.metrics.registry.get_sample_value("tokenpipe_generation_tokens_total",
                                                    {"model_name": worker.model}) or 0.0


async def test_a_stopping_generator_hands_its_waiting_room_back_at_once_and_drains_what_runs(
        settings: Settings, data_dir: Path) -> None:
    """One slot, one long request running and three waiting: on stop the three go back to the queue
    at once (never started by the drain) and another generator runs them; the first finishes the
    long one. Who generated what is read from each generator's token counter."""
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-handback"
    buses = [await connect_bus(settings, name=f"handback-{i}") for i in range(2)]
    first = GeneratorWorker(settings.replace(max_batch=1), loaded, buses[0])
    second = GeneratorWorker(settings.replace(max_batch=1), loaded, buses[1])
    await first.start()
    stopping: asyncio.Task[None] | None = None
    try:
        async with await Producer.connect(settings=settings.replace(app_name="rolling")) as app:
            long = await app.submit("tiny-handback", input_ids=prompt_of(1, 9), max_tokens=1500, temperature=0,
                                    ignore_eos=True)
            await wait_until(lambda: first.runner.running == 1, 30, "the long request running")
            short = [await app.submit("tiny-handback", input_ids=prompt_of(2 + i, 9), max_tokens=4, temperature=0,
                                      ignore_eos=True) for i in range(3)]
            await wait_until(lambda: len(first.active) == 4 and all(o.checked for o in first.active.values()),
                             30, "three requests waiting behind it")
            stopping = asyncio.create_task(first.stop(drain_timeout=120))
            await wait_until(lambda: len(first.active) == 1, 10, "the waiting ones handed back")
            await second.start()
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in short)), 60)
            assert all(r.finish == "length" and len(r.token_ids) == 4 for r in results)
            assert (await asyncio.wait_for(long.result(), 120)).finish == "length"
            await stopping
            assert generated(first) == 1500 and generated(second) == 3 * 4
    finally:
        if stopping is None:
            await first.stop(drain_timeout=1.0)
        await second.stop(drain_timeout=1.0)
        for bus in buses:
            await bus.close()


async def test_an_apps_request_past_its_tokens_per_minute_ends_with_an_error_batch_naming_the_quota(
        settings: Settings, data_dir: Path) -> None:
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-quota"
    bus = await connect_bus(settings, name="quota-generator")
    worker = GeneratorWorker(settings.replace(owner_tokens_per_min=100), loaded, bus)
    await worker.start()
    try:
        async with await Producer.connect(settings=settings.replace(app_name="metered")) as app:
            first = await (await app.submit("tiny-quota", input_ids=[5, 6, 7], max_tokens=60, temperature=0,
                                            ignore_eos=True)).result()
            assert first.finish == "length" and len(first.token_ids) == 60
            refused = await app.submit("tiny-quota", input_ids=[5, 6, 7], max_tokens=60, temperature=0)
            batches = [b async for b in app.stream(refused.id)]
            assert len(batches) == 1 and batches[0].finish == "error", batches
            assert batches[0].error_code == "rate_limit_exceeded"
            assert "TOKENPIPE_OWNER_TOKENS_PER_MIN" in (batches[0].error or "")
            assert re.search(r"retry after \d+ s", batches[0].error or ""), batches[0].error
    finally:
        await worker.stop(drain_timeout=1.0)
        await bus.close()


# -- at the edge -------------------------------------------------------------------------------------

async def test_a_tenant_past_its_tokens_per_minute_gets_a_429_with_retry_after(
        settings: Settings, generator: GeneratorWorker) -> None:
    relay = await start_relay(settings.replace(owner_tokens_per_min=50))
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=60) as http:
            body = {"prompt": "hi", "max_tokens": 40}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            for path in ("/v1/completions", "/v1/streams"):
                r = await http.post(path, json=body)
                assert r.status_code == 429, r.text
                assert 1 <= int(r.headers["retry-after"]) <= 60
                error = r.json()["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
                assert "TOKENPIPE_OWNER_TOKENS_PER_MIN" in error["message"], error
            # the SDK's relay client raises it with when to retry
            from producer.relay_socket import relay_error
            exc = relay_error(error["message"], error["code"], None, status=429, retry_after=r.headers["retry-after"])
            assert isinstance(exc, RateLimited) and exc.retry_after == int(r.headers["retry-after"])
    finally:
        await relay.stop()
