"""The relay as an internet-facing edge: keys, tenant isolation, limits, slow clients."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError

from generator.service.worker import GeneratorWorker
from producer import aiter_sse
from relay.auth import KeyRing, Unauthorized
from relay.http import SSEResponse, WriteWatchdog
from tokenpipe.settings import Settings

from .conftest import RelayServer, read_sse, start_relay, wait_until

LONG = {"prompt": "go on", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
async def keyed(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[RelayServer]:
    relay = await start_relay(settings.replace(api_keys="key-alice:alice,key-bob:bob", max_streams_per_key=2),
                              ready_headers={"Authorization": "Bearer key-alice"})
    yield relay
    await relay.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keyring_parsing(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nk3 carol\nk4:dave\n\n")
    ring = KeyRing.load("k1:alice, k2", str(f))
    assert ring.tenant_for("Bearer k1") == "alice"
    assert ring.tenant_for("bearer k3") == "carol" and ring.tenant_for("Bearer k4") == "dave"
    assert ring.tenant_for("Bearer k2").startswith("key-")
    for bad in (None, "", "Bearer", "Basic k1", "Bearer nope"):
        with pytest.raises(Unauthorized):
            ring.tenant_for(bad)
    assert KeyRing.load().tenant_for(None) == "default"


async def test_every_api_route_needs_a_key(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url) as http:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/streams"), ("GET", "/v1/streams/x"),
                             ("DELETE", "/v1/streams/x"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions"), ("GET", "/v1/streams"), ("GET", "/v1/streams/x/export")]:
            for headers in ({}, auth("wrong")):
                r = await http.request(method, path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (method, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/v1/models", headers=auth("key-bob"))).status_code == 200


async def test_openai_sdk_gets_authentication_error(keyed: RelayServer) -> None:
    bad = AsyncOpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        await bad.models.list()
    good = AsyncOpenAI(base_url=keyed.url + "/v1", api_key="key-alice", max_retries=0)
    resp = await good.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens >= 1


async def test_tenants_cannot_read_replay_resume_or_cancel_each_other(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        r = await http.post("/v1/streams", headers=auth("key-alice"),
                            json={"prompt": "secret", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        sid = r.json()["id"]
        async with http.stream("GET", f"/v1/streams/{sid}", headers=auth("key-alice")) as resp:
            mine = await read_sse(resp)
        assert mine[-1][0] == "done"
        for method, kw in [("GET", {}), ("GET", {"params": {"last_event_id": "0"}}),
                           ("GET", {"headers": {"Last-Event-ID": "0"}}), ("DELETE", {})]:
            headers = {**auth("key-bob"), **kw.pop("headers", {})}
            r = await http.request(method, f"/v1/streams/{sid}", headers=headers, **kw)
            assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        # bob's 404 is indistinguishable from a stream that never existed
        r2 = await http.get("/v1/streams/neverexisted", headers=auth("key-bob"))
        assert r2.json()["error"]["message"].replace("neverexisted", sid) == r.json()["error"]["message"]


async def test_bob_cannot_cancel_alice_mid_stream(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
        r = await http.post("/v1/streams", headers=auth("key-alice"),
                            json={**LONG, "max_tokens": 300, "coalesce": {"max_tokens": 0}})
        sid = r.json()["id"]
        assert (await http.delete(f"/v1/streams/{sid}", headers=auth("key-bob"))).status_code == 404
        async with http.stream("GET", f"/v1/streams/{sid}", headers=auth("key-alice")) as resp:
            events = await read_sse(resp)
    assert json.loads(events[-1][2])["finish"] == "length"


async def test_concurrent_streams_per_key_are_limited(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
        ids = [(await http.post("/v1/streams", headers=auth("key-alice"), json=LONG)).json()["id"] for _ in range(2)]
        async with http.stream("GET", f"/v1/streams/{ids[0]}", headers=auth("key-alice")) as a, \
                http.stream("GET", f"/v1/streams/{ids[1]}", headers=auth("key-alice")) as b:
            assert a.status_code == b.status_code == 200
            await wait_until(lambda: keyed.app.state.relay.forwarder.active["alice"] == 2, 10, "two open streams")
            r = await http.post("/v1/streams", headers=auth("key-alice"), json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"]
            assert r.json()["error"]["type"] == "rate_limit_error"
            other = await http.post("/v1/streams", headers=auth("key-bob"), json={"prompt": "x", "max_tokens": 2})
            assert other.status_code == 201
        for sid in ids:
            await http.delete(f"/v1/streams/{sid}", headers=auth("key-alice"))


async def test_deep_queue_answers_429(settings: Settings, generator: GeneratorWorker) -> None:
    """Fill every generator slot, let requests queue in JetStream, then the relay refuses more."""
    relay = await start_relay(settings.replace(max_queue_depth=2))
    created: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            # The batch fills first: wait until the generator runs every one of them (how fast it
            # pulls depends on the machine's load), so that what follows can only queue.
            await wait_until(lambda: not generator.active, 30, "earlier requests to finish")
            for _ in range(settings.max_batch):
                r = await http.post("/v1/streams", json=LONG)
                assert r.status_code == 201, r.text
                created.append(r.json()["id"])
            await wait_until(lambda: len(generator.active) == settings.max_batch, 30, "a full batch")
            statuses = []
            for _ in range(6):
                relay.app.state.relay.admission._queue_info.clear()  # read fresh consumer lag each time
                r = await http.post("/v1/streams", json=LONG)
                statuses.append(r.status_code)
                if r.status_code == 201:
                    created.append(r.json()["id"])
                else:
                    assert r.status_code == 429 and r.headers["retry-after"] == "2"
                    assert "waiting" in r.json()["error"]["message"]
                    break
            assert statuses[-1] == 429
            assert len(created) > settings.max_batch  # then the queue grew until it was too deep
    finally:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            for sid in created:
                await http.delete(f"/v1/streams/{sid}")
        await relay.stop()
    await wait_until(lambda: not generator.active, 30, "cancelled requests to drain")


async def test_slow_client_is_dropped_without_cancelling_generation() -> None:
    """A write that blocks longer than the deadline ends the response; the stream is not cancelled."""
    sent: list[bytes] = []
    closed = asyncio.Event()
    dropped: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.set()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 3:
            await anyio.sleep_forever()  # the client stopped reading: the socket is full
        sent.append(message.get("body", b""))

    resp = SSEResponse(body(), watchdog=WriteWatchdog(0.2), stream_id="slow", on_drop=lambda: dropped.append(True))
    with anyio.fail_after(5):
        await resp.stream_response(send)
    assert dropped == [True] and closed.is_set()
    assert len(sent) == 3  # response start + two events, then the stuck write was abandoned


# --- issue 15: no input produces a 5xx or a dropped connection ------------------------------------

CREATE_ROUTES = ["/v1/streams", "/v1/chat/completions", "/v1/completions"]
SURROGATE_BODIES = [
    b'{"prompt": "\\ud800"}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"messages": [{"role": "user\\ud800", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "x", "name": "\\udbff"}]}',
    b'{"prompt": "x", "stop": ["ok", "\\ud800"]}',
    b'{"prompt": "x", "model": "\\ud800"}',
    b'{"prompt": "x", "\\ud800": 1}',
]
HUGE_NUMBER_BODIES = [
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "x", "seed": ' + b"9" * 100 + b"}",
    b'{"prompt": "x", "seed": -' + b"9" * 30 + b"}",
    b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": [' + b"9" * 40 + b"]}",
    b'{"input_ids": [' + b"9" * 40 + b"]}",
]


@pytest.mark.parametrize("path", CREATE_ROUTES)
async def test_regression_lone_surrogate_was_a_500_on_every_create_route(keyed: RelayServer, path: str) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        for body in SURROGATE_BODIES:
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "lone UTF-16 surrogate, which is not valid UTF-8" in error["message"], error


@pytest.mark.parametrize("path", CREATE_ROUTES)
async def test_regression_numbers_of_any_size_were_a_500(keyed: RelayServer, path: str) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        for body in HUGE_NUMBER_BODIES:
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, body[:60], r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", CREATE_ROUTES)
async def test_any_nesting_depth_is_a_400(keyed: RelayServer, path: str) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        for depth in (5000, 100_000):
            body = b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 413), (path, depth, r.status_code)
            assert r.json()["error"]["type"] == "invalid_request_error"


async def test_regression_a_burst_of_bad_requests_drops_no_connection(keyed: RelayServer) -> None:
    bodies = SURROGATE_BODIES + HUGE_NUMBER_BODIES
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        results = await asyncio.gather(*(http.post(path, content=body) for path in CREATE_ROUTES for body in bodies))
    assert [r.status_code for r in results] == [400] * len(results)


async def test_regression_replay_speed_1e_320_stalled_forever(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        r = await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})
        sid = r.json()["id"]
        for speed in ("1e-320", "0.001", "-1", "1001", "nan", "inf", "-inf", "abc", "1" + "0" * 5000):
            r = await http.get(f"/v1/streams/{sid}", params={"replay": "true", "speed": speed})
            assert r.status_code == 400, (speed, r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "invalid_request_error"
        for speed in ("0", "0.01", "1000"):
            async with http.stream("GET", f"/v1/streams/{sid}", params={"replay": "true", "speed": speed}) as resp:
                assert resp.status_code == 200
                events = await read_sse(resp)
            assert events[-1][0] == "done"


async def test_query_values_and_ids_are_validated_never_500(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30, headers=auth("key-alice")) as http:
        sid = (await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})).json()["id"]
        for params in ({"last_event_id": "-1"}, {"last_event_id": "9" * 5000}, {"last_event_id": "1e3"},
                       {"last_event_id": "\u00b2"}, {"replay": "maybe"}, {"cancel_on_disconnect": "2"}):
            r = await http.get(f"/v1/streams/{sid}", params=params)
            assert r.status_code == 400, (params, r.status_code, r.text[:200])
        for header in ("-1", "9" * 40, "\u00b2".encode(), "1 2", ""):
            r = await http.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": header})
            assert r.status_code in (400,), (header, r.status_code)
        for bad in ("a.b", "x" * 65, "tp.tok.>", "%00", "a b"):
            for method in ("GET", "DELETE"):
                r = await http.request(method, f"/v1/streams/{bad}")
                assert r.status_code in (400, 404), (bad, method, r.status_code)
                assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")


async def test_regression_auth_came_after_routing_and_405_was_a_server_error(keyed: RelayServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
            for path in ("/v1/streams", "/v1/nope", "/v1/streams/x/y", "/v1/chat/completions", "/v1"):
                r = await http.request(method, path)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
        r = await http.put("/v1/streams", headers=auth("key-alice"))  # GET lists, POST creates
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        assert {"GET", "POST"} <= set(r.headers["allow"].split(", "))
        r = await http.put("/v1/chat/completions", headers=auth("key-alice"))
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.get("/v1/nope", headers=auth("key-alice"))
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await http.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert (await http.get("/metrics")).status_code == 200  # metrics_auth is off by default


async def test_metrics_auth_protects_metrics(settings: Settings, generator: GeneratorWorker) -> None:
    relay = await start_relay(settings.replace(api_keys="key-m:m", metrics_auth=True))
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.get("/metrics", headers=auth("key-m"))).status_code == 200
            assert (await http.get("/healthz")).status_code == 200
    finally:
        await relay.stop()


async def test_regression_unread_streams_locked_the_key_out_for_15_minutes(settings: Settings,
                                                                          generator: GeneratorWorker) -> None:
    relay = await start_relay(settings.replace(max_streams_per_key=2, unread_stream_release_s=0.5))
    created: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            for _ in range(2):
                created.append((await http.post("/v1/streams", json=LONG)).json()["id"])
            assert (await http.post("/v1/streams", json=LONG)).status_code == 429
            async def accepted() -> bool:
                r = await http.post("/v1/streams", json={"prompt": "y", "max_tokens": 2})
                if r.status_code == 201:
                    created.append(r.json()["id"])
                return r.status_code == 201

            await wait_until(accepted, 10, "an unread stream's slot to lapse")
    finally:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            for sid in created:
                await http.delete(f"/v1/streams/{sid}")
        await relay.stop()


# --- found by the schema-driven fuzzing (tests/test_schema.py) -----------------------------------

def test_regression_denormal_temperature_or_top_p_made_the_engine_fail_the_batch() -> None:
    """temperature=5e-324 passed "> 0" and overflowed the logits (softmax NaN); top_p=5e-324 rounds
    to 0 in float32 and dropped every token. Either failed the whole running batch (a 500)."""
    import torch

    from generator.engine.sampling import RowSampler, sample

    logits = torch.randn(3, 50)
    for temperature, top_p in ((5e-324, 1.0), (1.0, 5e-324), (1e-300, 1e-300), (2.0, 1e-45)):
        samplers = [RowSampler(temperature, top_p, top_k, torch.Generator().manual_seed(1)) for top_k in (0, 1, 5)]
        assert sample(logits, samplers) == logits.argmax(-1).tolist()


async def test_a_stream_being_read_holds_its_slot_and_releases_it_when_the_reader_leaves(
        settings: Settings, generator: GeneratorWorker) -> None:
    relay = await start_relay(settings.replace(max_streams_per_key=2, unread_stream_release_s=30.0,
                                               cancel_grace_s=30.0))
    admission = relay.app.state.relay.admission
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            sid = (await http.post("/v1/streams", json=LONG)).json()["id"]
            assert admission.open_streams["default"][sid] != float("inf")  # unread: a lapsing reservation
            async with http.stream("GET", f"/v1/streams/{sid}") as resp:
                async for _ in aiter_sse(resp):
                    break
                assert admission.open_streams["default"][sid] == float("inf")  # read: held
            await wait_until(lambda: admission.open_streams["default"].get(sid, 0) != float("inf"), 10,
                             "the slot to lapse again once nobody reads")
            await http.delete(f"/v1/streams/{sid}")
            assert sid not in admission.open_streams["default"]
    finally:
        await relay.stop()
