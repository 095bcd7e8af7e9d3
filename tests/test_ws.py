"""``/v1/ws``: many streams over one WebSocket, through a real client library (``websockets``)
against a real uvicorn relay and the real tiny generator."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from generator.service.worker import GeneratorWorker
from tokenpipe.bus import Bus
from tokenpipe.settings import Settings
from tokenpipe.streams import follow
from tokenpipe.wire import TokenBatch

from .conftest import RelayServer, read_sse, start_relay, wait_until

SHORT = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": "keep going", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "coalesce": {"max_tokens": 1}}
GRACE_S = 0.5


def ws_url(relay: RelayServer) -> str:
    return relay.url.replace("http://", "ws://") + "/v1/ws"


async def send(ws: ClientConnection, frame: Any) -> None:
    await ws.send(json.dumps(frame))


async def recv(ws: ClientConnection, timeout: float = 60) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))  # type: ignore[no-any-return]


async def reply_to(ws: ClientConnection, ref: Any, streams: dict[str, list[dict[str, Any]]] | None = None,
                   timeout: float = 60) -> dict[str, Any]:
    """The frame answering ``ref`` (stream frames read meanwhile go to ``streams``)."""
    while True:
        frame = await recv(ws, timeout)
        if frame.get("ref") == ref and frame["type"] not in ("tokens", "done", "gap"):
            return frame
        if streams is not None and "id" in frame:
            streams.setdefault(frame["id"], []).append(frame)


async def until_final(ws: ClientConnection, streams: dict[str, list[dict[str, Any]]], ids: set[str],
                      timeout: float = 120) -> None:
    """Read until every stream in ``ids`` had its ``done`` or ``error``."""
    def finished() -> set[str]:
        return {sid for sid in ids if any(f["type"] in ("done", "error") and "seq" in f for f in streams.get(sid, []))}

    while finished() != ids:
        frame = await recv(ws, timeout)
        if "id" in frame:
            streams.setdefault(frame["id"], []).append(frame)


def tokens_of(frames: list[dict[str, Any]]) -> list[int]:
    return [t for f in frames if f["type"] == "tokens" for t in f["token_ids"]]


@pytest.fixture(scope="module")
async def keyed(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[RelayServer]:
    relay = await start_relay(settings.replace(api_keys="key-alice:alice,key-bob:bob,key-alice2:alice",
                                               max_streams_per_key=2, cancel_grace_s=GRACE_S),
                              ready_headers={"Authorization": "Bearer key-alice"})
    yield relay
    await relay.stop()


async def test_one_socket_carries_many_streams_with_the_sse_tokens(relay: RelayServer, http: httpx.AsyncClient) -> None:
    async with connect(ws_url(relay)) as ws:
        streams: dict[str, list[dict[str, Any]]] = {}
        ids = []
        for i in range(5):
            await send(ws, {"type": "create", "ref": i, **SHORT, "prompt": f"story number {i}"})
            created = await reply_to(ws, i, streams)
            assert created["type"] == "created" and created["model"] == "tiny-random", created
            ids.append(created["id"])
        await until_final(ws, streams, set(ids))
    for sid in ids:
        frames = streams[sid]
        assert [f["seq"] for f in frames if f["type"] == "tokens"] == list(range(len(frames) - 1))
        assert frames[-1]["type"] == "done" and frames[-1]["finish"] == "length"
        assert frames[-1]["usage"]["completion_tokens"] == SHORT["max_tokens"]
        # The same stream read over SSE (history) carries exactly the same tokens.
        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            sse = [json.loads(d) for e, _, d in await read_sse(resp) if e == "tokens"]
        assert tokens_of(frames) == [t for d in sse for t in d["token_ids"]]
        assert "".join(f["text"] for f in frames if f["type"] == "tokens") == "".join(d["text"] for d in sse)


async def test_attach_resumes_after_seq_and_replays(relay: RelayServer, http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/streams", json=SHORT)
    sid = r.json()["id"]
    async with connect(ws_url(relay)) as ws:
        streams: dict[str, list[dict[str, Any]]] = {}
        await send(ws, {"type": "attach", "id": sid, "ref": "a"})
        assert (await reply_to(ws, "a", streams))["type"] == "attached"
        await until_final(ws, streams, {sid})
        whole = streams.pop(sid)
        await send(ws, {"type": "attach", "id": sid, "after_seq": 2, "ref": "b"})
        assert (await reply_to(ws, "b", streams))["type"] == "attached"
        await until_final(ws, streams, {sid})
        rest = streams.pop(sid)
        assert next(f["seq"] for f in rest if f["type"] == "tokens") == 3
        assert tokens_of(rest) == tokens_of([f for f in whole if f.get("seq", 0) > 2])
        await send(ws, {"type": "attach", "id": sid, "replay": True, "speed": 0, "ref": "c"})
        assert (await reply_to(ws, "c", streams))["type"] == "attached"
        await until_final(ws, streams, {sid})
        assert tokens_of(streams[sid]) == tokens_of(whole)


async def test_regression_ws_speed_1e_400_underflowed_to_0_and_replayed_as_fast_as_possible(
        relay: RelayServer, http: httpx.AsyncClient) -> None:
    """The frame's JSON parse read 1e-400 as 0.0 before any check; it is judged on the exact decimal,
    as the SSE route's ``speed`` query is (an error frame naming ``speed``)."""
    sid = (await http.post("/v1/streams", json=SHORT)).json()["id"]
    async with connect(ws_url(relay)) as ws:
        streams: dict[str, list[dict[str, Any]]] = {}
        for n, bad in enumerate(("1e-400", "-1e-400", "0.009999999999999999999999")):
            await ws.send(f'{{"type": "attach", "id": "{sid}", "replay": true, "speed": {bad}, "ref": {n}}}')
            err = await reply_to(ws, n, streams)
            assert err["type"] == "error" and err["code"] == "invalid_request" and err["param"] == "speed", (bad, err)
        assert not streams
        for n, zero in enumerate(("0", "0.0", "0e-999"), start=10):  # a zero written as a zero: as fast as possible
            await ws.send(f'{{"type": "attach", "id": "{sid}", "replay": true, "speed": {zero}, "ref": {n}}}')
            assert (await reply_to(ws, n, streams))["type"] == "attached", zero
            await until_final(ws, streams, {sid})
            streams.clear()


async def test_cancel_frame_stops_the_generation(relay: RelayServer, bus: Bus) -> None:
    async with connect(ws_url(relay)) as ws:
        streams: dict[str, list[dict[str, Any]]] = {}
        await send(ws, {"type": "create", "ref": 1, **LONG})
        sid = (await reply_to(ws, 1, streams))["id"]
        while not streams.get(sid):
            frame = await recv(ws)
            streams.setdefault(frame["id"], []).append(frame)
        await send(ws, {"type": "cancel", "id": sid, "ref": 2})
        assert (await reply_to(ws, 2, streams)) == {"type": "cancelled", "ref": 2, "id": sid}
        await until_final(ws, streams, {sid})
        done = streams[sid][-1]
        assert done["type"] == "done" and done["finish"] == "cancelled"
        assert done["usage"]["completion_tokens"] < LONG["max_tokens"]


async def test_bad_frames_get_error_frames_and_the_socket_stays_open(relay: RelayServer) -> None:
    async with connect(ws_url(relay)) as ws:
        cases: list[tuple[str | bytes, str]] = [
            ("not json", "invalid_request"), ("[1, 2]", "invalid_request"), (b"\x00binary", "invalid_request"),
            (json.dumps({"type": "nope"}), "invalid_request"), (json.dumps({"ref": 1}), "invalid_request"),
            (json.dumps({"type": "create", "prompt": "x", "max_tokens": -1}), "invalid_request"),
            (json.dumps({"type": "create", "prompt": "x", "bogus": 1}), "invalid_request"),
            (json.dumps({"type": "create", "prompt": "x", "model": "no-such-model"}), "model_not_found"),
            (json.dumps({"type": "attach", "id": "../x"}), "invalid_request"),
            (json.dumps({"type": "attach", "id": "0" * 26}), "stream_not_found"),
            (json.dumps({"type": "attach", "id": "0" * 26, "speed": 1e9, "replay": True}), "invalid_request"),
            (json.dumps({"type": "cancel", "id": "0" * 26}), "stream_not_found"),
            (json.dumps({"type": "ping", "ref": {"x": 1}}), "invalid_request"),
        ]
        for raw, code in cases:
            await ws.send(raw)
            frame = await recv(ws)
            assert frame["type"] == "error" and frame["code"] == code, (raw, frame)
            assert frame["message"] and frame["status"] >= 400
        await send(ws, {"type": "ping", "ref": "still-here"})
        assert await recv(ws) == {"type": "pong", "ref": "still-here"}


async def test_regression_a_ws_frame_was_held_to_max_body_bytes_in_characters_not_bytes(
        settings: Settings, generator: GeneratorWorker) -> None:
    """A frame of 57 characters but 87 bytes (UTF-8) passed a 64-byte ``max_body_bytes`` that refuses
    the same bytes as an HTTP body (413): the frame's length was taken in characters."""
    relay = await start_relay(settings.replace(max_body_bytes=64))
    try:
        async with connect(ws_url(relay)) as ws:
            await ws.send(json.dumps({"type": "ping", "pad": "é" * 30}, ensure_ascii=False))
            frame = await recv(ws)
            assert frame["type"] == "error" and frame["code"] == "request_too_large" and frame["status"] == 413
    finally:
        await relay.stop()


async def test_auth_by_header_or_first_frame_nothing_else_before_it(keyed: RelayServer) -> None:
    async with connect(ws_url(keyed), additional_headers={"Authorization": "Bearer key-alice"}) as ws:
        await send(ws, {"type": "ping", "ref": 1})
        assert await recv(ws) == {"type": "pong", "ref": 1}
    async with connect(ws_url(keyed)) as ws:
        for frame in ({"type": "ping"}, {"type": "create", **SHORT}, {"type": "attach", "id": "0" * 26}):
            await send(ws, frame)
            err = await recv(ws)
            assert err["type"] == "error" and err["code"] == "invalid_api_key" and err["status"] == 401
        await send(ws, {"type": "auth", "api_key": "wrong"})
        assert (await recv(ws))["code"] == "invalid_api_key"
        await send(ws, {"type": "auth", "api_key": "key-bob", "ref": "k"})
        assert await recv(ws) == {"type": "authenticated", "ref": "k"}
        await send(ws, {"type": "ping", "ref": 2})
        assert await recv(ws) == {"type": "pong", "ref": 2}
    for headers in ({"Authorization": "Bearer wrong"},
                    [("Authorization", "Bearer key-alice"), ("Authorization", "Bearer key-bob")]):
        async with connect(ws_url(keyed), additional_headers=headers) as ws:
            assert (await recv(ws))["code"] == "invalid_api_key"
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1008


async def test_tenants_cannot_attach_or_cancel_each_others_streams_and_limits_are_http_s(
        keyed: RelayServer, bus: Bus) -> None:
    async with connect(ws_url(keyed), additional_headers={"Authorization": "Bearer key-alice"}) as alice, \
            connect(ws_url(keyed), additional_headers={"Authorization": "Bearer key-bob"}) as bob:
        streams: dict[str, list[dict[str, Any]]] = {}
        ids = []
        for ref in (1, 2):
            await send(alice, {"type": "create", "ref": ref, **LONG})
            ids.append((await reply_to(alice, ref, streams))["id"])
        await send(alice, {"type": "create", "ref": 3, **SHORT})  # the key's third unfinished stream: 429
        limited = await reply_to(alice, 3, streams)
        assert limited["type"] == "error" and limited["code"] == "overloaded" and limited["status"] == 429
        assert limited["retry_after"] >= 1
        for frame in ({"type": "attach", "id": ids[0], "ref": 1}, {"type": "cancel", "id": ids[0], "ref": 2}):
            await send(bob, frame)
            err = await reply_to(bob, frame["ref"])
            assert err["type"] == "error" and err["code"] == "stream_not_found" and err["id"] == ids[0]
        for ref, sid in enumerate(ids):
            await send(alice, {"type": "cancel", "id": sid, "ref": 10 + ref})
        await until_final(alice, streams, set(ids))
        assert all(streams[sid][-1]["finish"] == "cancelled" for sid in ids)


async def test_closed_socket_cancels_only_under_the_viewer_rules(keyed: RelayServer, bus: Bus) -> None:
    headers = {"Authorization": "Bearer key-alice"}
    # A second reader (SSE) keeps the stream alive when the socket that created it closes ...
    async with connect(ws_url(keyed), additional_headers=headers) as ws:
        await send(ws, {"type": "create", "ref": 1, **LONG, "max_tokens": 300})
        created = await reply_to(ws, 1)
        sid = created["id"]
        await recv(ws)  # its first tokens: the socket's reader is attached
        async with httpx.AsyncClient(base_url=keyed.url, headers=headers, timeout=60) as http, \
                http.stream("GET", f"/v1/streams/{sid}") as resp:
            await ws.close()
            events = await read_sse(resp)
    assert events[-1][0] == "done" and json.loads(events[-1][2])["finish"] == "length"
    # ... and the last reader leaving (the socket) cancels it after the grace.
    async with connect(ws_url(keyed), additional_headers=headers) as ws:
        await send(ws, {"type": "create", "ref": 1, **LONG})
        sid = (await reply_to(ws, 1))["id"]
        await recv(ws)
    finals = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch) and b.is_final]
    assert finals[0].finish == "cancelled"


async def _raw_ws(port: int, path: str = "/v1/ws") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket handshake over a plain socket with a tiny receive buffer, whose reader then never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def _masked_text(text: str, *, zero_mask: bool = False) -> bytes:
    """A client text frame (clients must mask; a zero mask leaves the payload as it is, for floods)."""
    payload = text.encode()
    mask = b"\0\0\0\0" if zero_mask else os.urandom(4)
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_a_socket_that_stops_reading_is_dropped_without_slowing_others(
        settings: Settings, generator: GeneratorWorker, bus: Bus) -> None:
    relay = await start_relay(settings.replace(slow_client_timeout_s=1.0))
    try:
        # A socket whose client never reads, with one live stream ...
        _, slow = await _raw_ws(relay.port)
        slow.write(_masked_text(json.dumps({"type": "create", **LONG}, separators=(",", ":"))))
        forwarder = relay.app.state.relay.forwarder
        await wait_until(lambda: len(forwarder.readers) == 1, 30, "the slow socket's live stream")
        (live,) = list(forwarder.readers)
        # ... asks for far more than any socket buffers hold (the loopback's send buffer grows to
        # 4 MiB): 40,000 pings, each answered by a ~290-byte pong (12 MB).
        ping = _masked_text(json.dumps({"type": "ping", "ref": "p" * 256}, separators=(",", ":")), zero_mask=True)
        slow.write(ping * 40_000)
        # Meanwhile another socket on the same relay gets a whole stream.
        async with connect(ws_url(relay)) as fast:
            streams: dict[str, list[dict[str, Any]]] = {}
            await send(fast, {"type": "create", "ref": 1, **SHORT})
            other = (await reply_to(fast, 1, streams))["id"]
            await until_final(fast, streams, {other}, timeout=60)
            assert len(tokens_of(streams[other])) == SHORT["max_tokens"]
        # The slow socket is dropped (its reader released) while its live generation goes on.
        drops = relay.app.state.relay.metrics.errors.labels(kind="ws_slow_client")
        await wait_until(lambda: drops._value.get() == 1, 60, "the slow socket to be dropped")
        await wait_until(lambda: not forwarder.readers, 10, "the dropped socket's reader to be released")
        finals = [b async for b in follow(bus, live) if isinstance(b, TokenBatch) and b.is_final]
        assert finals[0].finish == "length", finals[0]
        slow.close()  # the relay has dropped it already
    finally:
        await relay.stop()


@pytest.mark.parametrize("transport", ["sse", "websocket"])
async def test_relay_client_transports_give_the_same_events(relay: RelayServer, transport: str) -> None:
    from producer import RelayClient
    from tokenpipe.errors import InvalidRequest, ModelNotFound, StreamNotFound

    async with RelayClient(relay.url) as sse, RelayClient(relay.url, transport=transport) as client:
        sid = await client.create(prompt="Hello there", max_tokens=25, temperature=0, ignore_eos=True)
        events = [e async for e in client.events(sid)]
        assert events == [e async for e in sse.events(sid)]  # event names, data and ids alike
        assert events[-1].event == "done" and events[-1].json()["finish"] == "length"
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


async def test_relay_pings_and_closes_a_socket_that_never_answers(settings: Settings,
                                                                  generator: GeneratorWorker) -> None:
    relay = await start_relay(settings.replace(keepalive_s=0.5, slow_client_timeout_s=1.0))
    try:
        reader, writer = await _raw_ws(relay.port)  # a client that reads but never answers a ping
        opcodes = []
        while True:
            try:
                head = await asyncio.wait_for(reader.readexactly(2), 20)
            except asyncio.IncompleteReadError:
                break  # the relay closed the connection
            n = head[1] & 0x7F
            await reader.readexactly(n)
            opcodes.append(head[0] & 0x0F)
            if opcodes[-1] == 0x8:
                break  # a close frame
        writer.close()
        assert opcodes and opcodes[0] == 0x9, opcodes  # a ping came first
        # A real client answers the pings: its socket stays open past several intervals.
        async with connect(ws_url(relay)) as ws:
            for ref in range(4):
                await asyncio.sleep(1.0)  # idle on purpose: the relay's pings keep the socket alive
                await send(ws, {"type": "ping", "ref": ref})
                assert await recv(ws, 10) == {"type": "pong", "ref": ref}
    finally:
        await relay.stop()
