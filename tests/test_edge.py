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

from generator.worker import GeneratorWorker
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
                             ("POST", "/v1/completions")]:
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
