"""Classes of service (issue 46, part 1): ``service_tier`` on every way in, interactive work admitted
before batch (``flex``) work, a batch row preempted for it and resumed with the tokens of an
uninterrupted run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from generator.engine.scheduler import Engine, Sequence
from generator.model.kvcache import BLOCK_SIZE, bytes_per_position
from generator.model.loader import LoadedModel
from generator.service.worker import LOOKAHEAD, GeneratorWorker
from tokenpipe.bus import Bus
from tokenpipe.settings import Settings
from tokenpipe.subjects import request_subject
from tokenpipe.wire import SERVICE_TIERS, SamplingParams

from .conftest import RelayServer, wait_until
from .test_ws import recv, send, ws_url


def params(n: int, seed: int | None) -> SamplingParams:
    """Greedy (``seed`` None) or seeded sampling of ``n`` tokens, never stopping early."""
    if seed is None:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=n, temperature=0.9, top_k=50, seed=seed, ignore_eos=True)


def alone(lm: LoadedModel, prompt: list[int], p: SamplingParams) -> list[int]:
    """The tokens of an uninterrupted run: alone in the batch, no prefix cache."""
    engine = Engine(lm, max_batch=1, max_seq_len=256, prefix_caching=False)
    seq = engine.new_sequence("ref", prompt, p)
    engine.add(seq)
    engine.run_to_completion()
    return seq.generated


def prompt_of(i: int, length: int) -> list[int]:
    return [(37 * i + 11 * j) % 400 + 3 for j in range(length)]


# -- the engine ---------------------------------------------------------------------------------

def test_an_interactive_request_is_admitted_before_waiting_batch_work_and_preempts_a_batch_row(
        tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=2, max_seq_len=256)
    batch = [engine.new_sequence(f"b{i}", prompt_of(i, 2 * BLOCK_SIZE + 5), params(30, None), batch=True)
             for i in range(3)]
    for seq in batch:
        engine.add(seq)
    engine.step()
    assert [s.id for s in engine.rows] == ["b0", "b1"] and [s.id for s in engine.waiting] == ["b2"]
    chat = engine.new_sequence("chat", prompt_of(9, 7), params(4, None))
    engine.add(chat)
    assert [s.id for s in engine.waiting] == ["chat", "b2"]  # ahead of the batch work that waited before it
    engine.step()
    # the youngest batch row made way; the batch request that waited still waits, behind the preempted one
    assert [s.id for s in engine.rows] == ["b0", "chat"] and engine.preemptions == 1
    assert [s.id for s in engine.waiting] == ["b1", "b2"]
    # its full blocks stay cached as its prefix
    assert all(key in engine.pool.by_key for key in batch[1].keys[:2])
    queried = engine.pool.query_tokens
    engine.run_to_completion()
    assert chat.generated == alone(tiny_model, chat.prompt, chat.params)
    for seq in batch:
        assert seq.generated == alone(tiny_model, seq.prompt, seq.params), seq.id
    assert engine.pool.query_tokens == queried + len(batch[2].prompt)  # a resume is no new query
    assert engine.pool.used == 0


def test_a_batch_row_is_preempted_for_an_interactive_request_short_of_kv_blocks(tiny_model: LoadedModel) -> None:
    """Slots free, blocks short: the batch row goes, and the interactive one is admitted that step."""
    blocks = 6
    mb = blocks * BLOCK_SIZE * bytes_per_position(tiny_model.model, tiny_model.dtype) / 2**20
    engine = Engine(tiny_model, max_batch=4, max_seq_len=64, kv_cache_mb=mb, admit_reserve_tokens=BLOCK_SIZE)
    long = engine.new_sequence("offline", prompt_of(1, 3 * BLOCK_SIZE + 2), params(12, 5), batch=True)
    engine.add(long)
    engine.step()
    chat = engine.new_sequence("chat", prompt_of(2, 2 * BLOCK_SIZE + 1), params(6, 7))
    engine.add(chat)
    engine.step()
    assert chat in engine.rows and long not in engine.rows and engine.preemptions == 1
    engine.run_to_completion()
    assert chat.generated == alone(tiny_model, chat.prompt, chat.params)
    assert long.generated == alone(tiny_model, long.prompt, long.params)


def test_interactive_rows_are_never_preempted_for_interactive_work(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=1, max_seq_len=128)
    first = engine.new_sequence("first", prompt_of(1, 9), params(8, None))
    engine.add(first)
    engine.step()
    second = engine.new_sequence("second", prompt_of(2, 9), params(3, None))
    engine.add(second)
    engine.step()
    assert engine.rows == [first] and engine.preemptions == 0


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, list[tuple[int, bool, int, int, int | None]]]:
    """Slots, then per request: (arrival step, batch?, prompt length, new tokens, seed or None)."""
    slots = draw(st.integers(1, 3))
    reqs = draw(st.lists(st.tuples(st.integers(0, 12), st.booleans(), st.integers(1, 3 * BLOCK_SIZE),
                                   st.integers(1, 20), st.none() | st.integers(0, 2**31)),
                         min_size=2, max_size=7))
    return slots, reqs


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules())
def test_tokens_identical_whatever_the_classes_arrivals_and_preemptions(
        tiny_model: LoadedModel, schedule: tuple[int, list[tuple[int, bool, int, int, int | None]]]) -> None:
    """Greedy and seeded: every request's tokens are those of its run alone, however often it was
    preempted for interactive work; interactive work is never left waiting while a batch row runs."""
    slots, reqs = schedule
    engine = Engine(tiny_model, max_batch=slots, max_seq_len=128)
    seqs: list[Sequence] = []
    step = 0
    while step <= 12 or not engine.idle:
        for i, (at, batch, length, n, seed) in enumerate(reqs):
            if at == step:
                seqs.append(engine.new_sequence(f"r{i}", prompt_of(i, length), params(n, seed), batch=batch))
                engine.add(seqs[-1])
        engine.step()
        assert not ([s for s in engine.waiting if not s.batch] and [s for s in engine.rows if s.batch])
        step += 1
    for seq in seqs:
        assert seq.generated == alone(tiny_model, seq.prompt, seq.params), (seq.id, engine.preemptions)
    assert engine.pool.used == 0


# -- the ways in ---------------------------------------------------------------------------------

async def test_an_unknown_service_tier_is_a_400_naming_the_accepted_ones(http: httpx.AsyncClient) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/streams", {"prompt": "hi"})):
        r = await http.post(path, json={**body, "max_tokens": 2, "service_tier": "urgent"})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "service_tier", error
        assert all(f"'{tier}'" in error["message"] for tier in SERVICE_TIERS), error


async def test_responses_echo_the_tier_served_as_openai_does(http: httpx.AsyncClient) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for asked, served in ((None, "default"), ("auto", "default"), ("default", "default"), ("flex", "flex"),
                          ("priority", "priority")):
        tier = {} if asked is None else {"service_tier": asked}
        reply = await http.post("/v1/chat/completions", json={**chat, **tier})
        assert reply.status_code == 200 and reply.json()["service_tier"] == served, reply.text
        created = await http.post("/v1/streams", json={"prompt": "hi", "max_tokens": 2, **tier})
        assert created.status_code == 201 and created.json()["service_tier"] == served, created.text
    async with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True,
                                                            "service_tier": "flex"}) as r:
        chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                  if line.startswith("data: {")]
    assert chunks and all(c["service_tier"] == "flex" for c in chunks)


async def test_the_websocket_create_frame_takes_service_tier(relay: RelayServer) -> None:
    async with connect(ws_url(relay)) as ws:
        await send(ws, {"type": "create", "ref": 1, "prompt": "hi", "max_tokens": 2, "service_tier": "flex"})
        created = await recv(ws)
        assert created["type"] == "created" and created["service_tier"] == "flex", created
        await send(ws, {"type": "create", "ref": 2, "prompt": "hi", "max_tokens": 2, "service_tier": "later"})
        while (frame := await recv(ws))["type"] != "error" or frame.get("ref") != 2:
            pass
        assert frame["code"] == "invalid_request" and frame["param"] == "service_tier", frame


async def test_an_unknown_service_tier_on_the_bus_ends_the_stream_with_an_error_batch(
        bus: Bus, generator: GeneratorWorker) -> None:
    """A peer that does not validate (the SDK refuses it before publishing) gets an error batch."""
    from producer import Producer

    raw = {"v": 1, "id": "tier-on-the-bus", "model": "tiny-random", "prompt": "hi", "service_tier": "urgent"}
    await bus.js.publish(request_subject("tiny-random", bus.owner), msgpack.packb(raw))
    batches = [b async for b in Producer(bus).stream("tier-on-the-bus")]
    assert len(batches) == 1 and batches[0].finish == "error" and batches[0].error_code == "invalid_request"
    assert all(f"'{tier}'" in (batches[0].error or "") for tier in SERVICE_TIERS), batches[0].error


# -- end to end ----------------------------------------------------------------------------------

async def test_an_interactive_request_behind_a_batch_backlog_finishes_before_it(
        settings: Settings, data_dir: Path, tmp_path: Path) -> None:
    """A generator with two slots finds four batch requests in its queue and runs two; a chat then
    arrives behind the other two: it preempts a batch row and its last batch is stored before any
    batch request's (JetStream's own order); every stream has the tokens it has alone (greedy and
    seeded). The chat is sent once both rows run (found together with the backlog, it would simply be
    admitted first, and whether one fetch takes all five is up to the machine's speed)."""
    from generator.model.loader import load_model
    from producer import Producer
    from tokenpipe.bus import connect as connect_bus
    from tokenpipe.streams import history_at
    from tokenpipe_cli.natsserver import NatsServer

    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-lanes"
    server = NatsServer(tmp_path / "nats")  # its own: the backlog is queued before any generator runs
    server.start()
    settings = settings.replace(nats_url=server.url)
    bus = await connect_bus(settings, name="lanes-generator")
    worker = GeneratorWorker(settings.replace(max_batch=2), loaded, bus)
    backlog = 4
    assert backlog + 1 <= 2 + LOOKAHEAD  # within the generator's reach: the chat is fetched while two wait
    try:
        async with await Producer.connect(settings=settings) as producer:
            jobs: list[tuple[Any, list[int], SamplingParams]] = []
            for i in range(backlog):
                p = params(160, None if i % 2 else 100 + i)
                handle = await producer.submit("tiny-lanes", input_ids=prompt_of(i, 20), service_tier="flex",
                                               max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                               seed=p.seed, ignore_eos=True)
                jobs.append((handle, prompt_of(i, 20), p))
            await worker.start()
            await wait_until(lambda: worker.runner.stats().running == 2, 60, "two batch rows running")
            chat_params = params(4, None)
            chat = await producer.submit("tiny-lanes", input_ids=prompt_of(9, 12), max_tokens=4, temperature=0,
                                         ignore_eos=True)
            results = await asyncio.wait_for(asyncio.gather(chat.result(), *(h.result() for h, _, _ in jobs)), 180)
            assert results[0].token_ids == alone(loaded, prompt_of(9, 12), chat_params)
            for res, (_, prompt, p) in zip(results[1:], jobs, strict=True):
                assert res.finish == "length" and res.token_ids == alone(loaded, prompt, p), res.id
            chat_last = (await history_at(producer.bus, chat.id))[1]
            backlog_last = [(await history_at(producer.bus, h.id))[1] for h, _, _ in jobs]
            assert chat_last < min(backlog_last), (chat_last, backlog_last)
            assert worker.runner.stats().preemptions >= 1
    finally:
        await worker.stop(drain_timeout=1.0)
        await bus.close()
        server.stop()
