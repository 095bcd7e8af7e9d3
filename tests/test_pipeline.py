"""End to end with real parts: nats-server, the engine, uvicorn, httpx and the SDK."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import msgpack
import pytest

from generator.engine.runner import FirstBatchGate, encode_prompt
from generator.engine.scheduler import Engine
from generator.model.loader import LoadedModel
from generator.service.worker import GeneratorWorker
from producer import Producer, RelayClient, aiter_sse
from relay.app import create_app
from tokenpipe.bus import Bus
from tokenpipe.errors import InvalidRequest, ModelNotFound, StreamNotFound
from tokenpipe.settings import Settings
from tokenpipe.streams import follow
from tokenpipe.subjects import RELAY_OWNER, request_subject, stream_key
from tokenpipe.wire import Request, SamplingParams, TokenBatch
from tokenpipe_cli.launch import free_port
from tokenpipe_cli.natsserver import NatsServer

from .conftest import RelayServer, read_sse, wait_until

MESSAGES = [{"role": "user", "content": "Tell me about NATS."}]


def in_process(lm: LoadedModel, req: Request) -> str:
    """What the engine produces for ``req`` when called directly (the reference)."""
    engine = Engine(lm, max_batch=1)
    seq = engine.new_sequence(req.id, encode_prompt(lm.tokenizer, req), req.params)
    engine.add(seq)
    engine.run_to_completion()
    return str(lm.tokenizer.decode(seq.generated, skip_special_tokens=True))


async def stream_events(http: httpx.AsyncClient, stream_id: str, **params: str) -> list[tuple[str, str | None, dict]]:
    async with http.stream("GET", f"/v1/streams/{stream_id}", params=params) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        return [(e, i, json.loads(d)) for e, i, d in await read_sse(resp)]


def check_contiguous(token_events: list[dict]) -> None:
    expected = 0
    for seq, ev in enumerate(token_events):
        assert ev["seq"] == seq
        assert ev["index"] == expected
        expected += len(ev["token_ids"])


async def test_http_stream_matches_in_process_engine(http: httpx.AsyncClient, tiny_model: LoadedModel) -> None:
    # A count window of 40 and a time window no step reaches: the first token goes out alone,
    # the other 39 in the final batch, whatever the machine's speed (the test owns the timing).
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "coalesce": {"max_tokens": 40, "max_delay_ms": 10_000}}
    resp = await http.post("/v1/streams", json=body)
    assert resp.status_code == 201, resp.text
    sid = resp.json()["id"]
    assert resp.headers["x-request-id"] == sid
    events = await stream_events(http, sid)
    kinds = [e for e, _, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"tokens"}
    tokens = [d for e, _, d in events if e == "tokens"]
    check_contiguous(tokens)
    assert [int(i) for e, i, _ in events if e == "tokens"] == [d["seq"] for d in tokens]
    done = events[-1][2]
    assert done["finish"] == "length"
    assert done["usage"]["completion_tokens"] == 40 == sum(len(d["token_ids"]) for d in tokens)
    assert [len(d["token_ids"]) for d in tokens] == [1, 39]  # coalesced by the count window
    ref = Request.from_map({"v": 1, "id": "ref", "model": "tiny-random", "messages": MESSAGES,
                            "params": {"max_tokens": 40, "temperature": 0, "ignore_eos": True}})
    assert "".join(d["text"] for d in tokens) == in_process(tiny_model, ref)


async def test_sdk_submit_matches_in_process_engine(settings: Settings, generator: GeneratorWorker,
                                                    tiny_model: LoadedModel) -> None:
    async with await Producer.connect(settings=settings) as producer:
        handle = await producer.submit("tiny-random", prompt="Hello there", max_tokens=25, temperature=0,
                                       ignore_eos=True)
        deltas = [t async for t in handle.text()]
        result = await handle.result()
    ref = Request.from_map({"v": 1, "id": "ref", "model": "tiny-random", "prompt": "Hello there",
                            "params": {"max_tokens": 25, "temperature": 0, "ignore_eos": True}})
    assert result.text == "".join(deltas) == in_process(tiny_model, ref)
    assert result.finish == "length" and result.usage is not None and result.usage.completion_tokens == 25
    assert len(result.token_ids) == 25


async def test_relay_client_streams_resumes_and_cancels(relay: RelayServer, tiny_model: LoadedModel) -> None:
    async with RelayClient(relay.url) as client:
        sid = await client.create(prompt="Hello there", max_tokens=25, temperature=0, ignore_eos=True)
        events = [e async for e in client.events(sid)]
        assert events[-1].event == "done" and events[-1].json()["finish"] == "length"
        tokens = [e.json() for e in events if e.event == "tokens"]
        check_contiguous(tokens)
        ref = Request.from_map({"v": 1, "id": "ref", "model": "tiny-random", "prompt": "Hello there",
                                "params": {"max_tokens": 25, "temperature": 0, "ignore_eos": True}})
        assert "".join(t["text"] for t in tokens) == in_process(tiny_model, ref)
        assert [e async for e in client.events(sid, last_event_id=int(events[0].id or 0))] == events[1:]

        long = await client.create(prompt="a long one", max_tokens=2000, temperature=0, ignore_eos=True,
                                   coalesce={"max_tokens": 0})
        seen = []
        async for event in client.events(long):
            seen.append(event)
            if len(seen) == 2:
                await client.cancel(long)
        assert seen[-1].event == "done" and seen[-1].json()["finish"] == "cancelled"

        with pytest.raises(StreamNotFound):
            [e async for e in client.events("doesnotexist123")]
        with pytest.raises(ModelNotFound):
            await client.create(prompt="x", model="no-such-model")
        with pytest.raises(InvalidRequest) as bad:
            await client.create(prompt="x", temperature=9)
        assert bad.value.param == "temperature"


async def test_concurrent_requests_of_different_lengths(http: httpx.AsyncClient) -> None:
    lengths = [7, 60]
    ids = []
    for n in lengths:
        r = await http.post("/v1/streams", json={"prompt": f"count to {n}", "max_tokens": n, "temperature": 0,
                                                 "ignore_eos": True})
        ids.append(r.json()["id"])
    results = await asyncio.gather(*(stream_events(http, i) for i in ids))
    for n, events in zip(lengths, results, strict=False):
        tokens = [d for e, _, d in events if e == "tokens"]
        check_contiguous(tokens)
        assert events[-1][0] == "done" and events[-1][2]["finish"] == "length"
        assert sum(len(d["token_ids"]) for d in tokens) == n


async def test_every_token_when_coalescing_is_off(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json={"prompt": "one by one", "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True, "coalesce": {"max_tokens": 0}})
    events = await stream_events(http, r.json()["id"])
    tokens = [d for e, _, d in events if e == "tokens"]
    assert [len(d["token_ids"]) for d in tokens] == [1] * 12


async def test_delete_cancels_mid_stream_and_frees_the_slot(http: httpx.AsyncClient,
                                                            generator: GeneratorWorker) -> None:
    r = await http.post("/v1/streams", json={"prompt": "a very long story", "max_tokens": 2000, "temperature": 0,
                                             "ignore_eos": True, "coalesce": {"max_tokens": 0}})
    sid = r.json()["id"]
    events: list[tuple[str, dict]] = []
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        async for ev in aiter_sse(resp):
            events.append((ev.event, ev.json()))
            if len(events) == 3:
                running = len(generator.runner.engine.rows)
                assert running >= 1
                d = await http.delete(f"/v1/streams/{sid}")
                assert d.status_code == 200 and d.json()["cancelled"] is True
            if ev.event in ("done", "error"):
                break
    assert events[-1][0] == "done" and events[-1][1]["finish"] == "cancelled"
    generated = events[-1][1]["usage"]["completion_tokens"]
    assert 3 <= generated < 2000
    key = stream_key(RELAY_OWNER, sid)  # what the worker and the engine hold a stream by
    assert key not in generator.active
    await wait_until(lambda: all(s.id != key for s in generator.runner.engine.rows), 10, "engine to drop the row")


async def test_client_disconnect_cancels_generation(http: httpx.AsyncClient, generator: GeneratorWorker,
                                                    bus: Bus) -> None:
    r = await http.post("/v1/streams", json={"prompt": "never read to the end", "max_tokens": 2000,
                                             "temperature": 0, "ignore_eos": True})
    sid = r.json()["id"]
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        async for _ in aiter_sse(resp):
            break  # first batch seen: hang up
    final = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch) and b.is_final]
    assert final[0].finish == "cancelled"
    assert final[0].usage is not None and final[0].usage.completion_tokens < 2000


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "x", "temperature": 9}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": 12}, 400, "prompt"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"prompt": "x", "stop": {"a": 1}}, 400, "stop"),
    ({"prompt": "x", "temprature": 1}, 400, "temprature"),
    ({}, 400, None),
    ({"prompt": "x", "model": "bad.model"}, 400, "model"),
])
async def test_invalid_requests_get_openai_style_4xx(http: httpx.AsyncClient, body: dict, status: int,
                                                     param: str | None) -> None:
    r = await http.post("/v1/streams", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


@pytest.mark.parametrize("raw", [b"{bad json", b"[1,2]", b"\xff\xfe", b"null"])
async def test_malformed_json_is_400(http: httpx.AsyncClient, raw: bytes) -> None:
    r = await http.post("/v1/streams", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


async def test_oversized_body_is_413(http: httpx.AsyncClient, settings: Settings) -> None:
    r = await http.post("/v1/streams", json={"prompt": "x" * (settings.max_body_bytes + 10)})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


async def test_prompt_longer_than_context_ends_with_error_event(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json={"input_ids": [5] * 2100, "max_tokens": 5})
    assert r.status_code == 201
    events = await stream_events(http, r.json()["id"])
    assert [e for e, _, _ in events] == ["error"]
    assert "context" in events[0][2]["message"]


async def test_unknown_stream_is_404(http: httpx.AsyncClient) -> None:
    for method in ("GET", "DELETE"):
        r = await http.request(method, "/v1/streams/doesnotexist123")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "stream_not_found"


async def test_malformed_msgpack_is_terminated_and_worker_keeps_serving(bus: Bus, http: httpx.AsyncClient,
                                                                       generator: GeneratorWorker) -> None:
    subject = request_subject("tiny-random", bus.owner)
    await bus.js.publish(subject, b"\xc1\xc1 definitely not msgpack")
    await bus.js.publish(subject, msgpack.packb(["a", "list"]))
    # decodable, has an id, but invalid: the stream gets an error batch
    bad = msgpack.packb({"v": 1, "id": "badparams1", "model": "tiny-random", "prompt": "x",
                         "params": {"temperature": "hot"}})
    await bus.js.publish(subject, bad)
    batches = [b async for b in follow(bus, "badparams1") if isinstance(b, TokenBatch)]
    assert batches[-1].finish == "error" and "temperature" in (batches[-1].error or "")
    r = await http.post("/v1/streams", json={"prompt": "still alive?", "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True})
    events = await stream_events(http, r.json()["id"])
    assert events[-1][0] == "done"

    async def queue_empty() -> bool:
        info = await bus.js.consumer_info("TP_REQUESTS", "gen-tiny-random")
        return info.num_ack_pending == 0 and info.num_pending == 0

    await wait_until(queue_empty, 10, "bad messages to leave the work queue")


@pytest.mark.parametrize("max_tokens", [1, 64])
async def test_reused_stream_id_is_refused_though_the_engine_started_before_the_check(
        bus: Bus, http: httpx.AsyncClient, generator: GeneratorWorker, max_tokens: int) -> None:
    """The engine starts a first delivery before its stream id is checked (the lookup is off the
    first token's path): whether it finished meanwhile (1 token) or is still running when the check
    says the id is taken, nothing is appended to the existing stream and its slot is freed."""
    r = await http.post("/v1/streams", json={"prompt": "original", "max_tokens": 3, "temperature": 0})
    sid = r.json()["id"]
    before = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch)]
    assert before[-1].is_final
    reuse = Request.build("tiny-random", prompt="hijack", params={"max_tokens": max_tokens, "ignore_eos": True},
                          request_id=sid)
    await bus.js.publish(request_subject("tiny-random", bus.owner), reuse.encode(),
                         headers={"Nats-Msg-Id": f"reuse-{max_tokens}-{sid}"})  # past the dedup window, as it were

    async def refused() -> bool:
        info = await bus.js.consumer_info("TP_REQUESTS", "gen-tiny-random")
        return (info.num_ack_pending == 0 and info.num_pending == 0
                and stream_key(bus.owner, sid) not in generator.active)

    await wait_until(refused, 20, "the reused id to be refused and its slot freed")
    after = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch)]
    assert [(b.seq, b.token_ids, b.finish) for b in after] == [(b.seq, b.token_ids, b.finish) for b in before]
    assert generator.free_slots == generator.settings.max_batch


async def test_stop_strings_cut_the_text(http: httpx.AsyncClient, tiny_model: LoadedModel) -> None:
    ref = Request.from_map({"v": 1, "id": "ref", "model": "tiny-random", "prompt": "stop here",
                            "params": {"max_tokens": 30, "temperature": 0, "ignore_eos": True}})
    full = in_process(tiny_model, ref)
    stop = full[10:14]
    assert stop.strip(), full
    r = await http.post("/v1/streams", json={"prompt": "stop here", "max_tokens": 30, "temperature": 0,
                                             "ignore_eos": True, "stop": [stop]})
    events = await stream_events(http, r.json()["id"])
    text = "".join(d["text"] for e, _, d in events if e == "tokens")
    assert events[-1][2]["finish"] == "stop"
    assert text == full[: full.index(stop)]


async def test_health_and_readiness(http: httpx.AsyncClient) -> None:
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    ready = await http.get("/readyz")
    assert ready.status_code == 200 and "tiny-random" in ready.json()["models"]
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny-random"]


async def test_readyz_is_503_without_generators(settings: Settings, tmp_path: Path) -> None:
    """A relay on a NATS with no generator is live but not ready, and refuses work clearly."""
    with NatsServer(tmp_path / "empty-nats") as empty:
        server = await RelayServer(create_app(settings.replace(nats_url=empty.url)), free_port()).start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as c:
                assert (await c.get("/healthz")).status_code == 200
                r = await c.get("/readyz")
                assert r.status_code == 503 and r.json() == {"status": "unavailable", "ready": False, "nats": True,
                                                      "models": [], "generators": "0"}
                r = await c.post("/v1/streams", json={"prompt": "x"})
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        finally:
            await server.stop()


async def test_page_is_served(http: httpx.AsyncClient) -> None:
    r = await http.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "EventSource" in r.text and "/v1/streams" in r.text


def test_sampling_param_defaults_are_sane() -> None:
    p = SamplingParams()
    assert p.max_tokens > 0 and p.temperature == 1.0 and p.top_p == 1.0


async def test_finished_stream_reads_again_and_resumes_after_any_batch(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json={"prompt": "history", "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True, "coalesce": {"max_tokens": 3, "max_delay_ms": 1000}})
    sid = r.json()["id"]
    full = await stream_events(http, sid)
    again = await stream_events(http, sid)
    assert again == full
    seqs = [int(i) for e, i, _ in full if e == "tokens"]
    for last in seqs:
        async with http.stream("GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": str(last)}) as resp:
            tail = [(e, i, json.loads(d)) for e, i, d in await read_sse(resp)]
        assert tail == [ev for ev in full if int(ev[1] or 0) > last or (ev[0] == "done" and last == seqs[-1])]
    by_query = await stream_events(http, sid, last_event_id=str(seqs[0]))
    assert by_query == full[1:]


async def test_resume_after_final_batch_ends_with_done_instead_of_hanging(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json={"prompt": "end", "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    sid = r.json()["id"]
    full = await stream_events(http, sid)
    final_id = full[-1][1]
    tail = await asyncio.wait_for(stream_events(http, sid, last_event_id=str(final_id)), timeout=20)
    assert tail == [full[-1]]


def test_first_batch_gate_waits_for_every_expected_stream_and_no_longer_than_its_limit() -> None:
    gate = FirstBatchGate(limit_s=60, hold_s=0)
    gate.expect(["a", "b"])
    waiter = threading.Thread(target=gate.wait)
    waiter.start()
    gate.sent("a")
    gate.sent("other")  # another stream's batch releases nothing
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.sent("b")
    waiter.join(30)
    assert not waiter.is_alive() and (gate.waits, gate.timeouts) == (1, 0)

    short = FirstBatchGate(limit_s=0.05, hold_s=0)
    short.expect(["never-sent"])  # refused, or its id taken: the step goes on after the limit
    short.wait()
    short.wait()  # and it is not waited for again
    assert (short.waits, short.timeouts) == (2, 1)


async def test_the_engine_waited_for_a_first_batch_to_go_out_live_before_its_next_step(
        http: httpx.AsyncClient, generator: GeneratorWorker) -> None:
    """On a CPU the engine thread gives the cores to the first batch's way out (the worker's
    publisher tells the gate when its live copy is sent); a broken link would end every wait at
    the limit, which here is a minute."""
    wired_gate = generator.runner.first_batches
    assert wired_gate is not None and generator.publisher.on_live == wired_gate.sent  # wired on a CPU worker
    gate = FirstBatchGate(limit_s=60, hold_s=0)
    wired = generator.runner.first_batches, generator.publisher.on_live
    generator.runner.first_batches, generator.publisher.on_live = gate, gate.sent
    try:
        for _ in range(2):
            resp = await http.post("/v1/streams", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True})
            assert resp.status_code == 201, resp.text
            events = await stream_events(http, resp.json()["id"])
            assert events[-1][0] == "done"
    finally:
        generator.runner.first_batches, generator.publisher.on_live = wired
    assert (gate.waits, gate.timeouts) == (2, 0)
