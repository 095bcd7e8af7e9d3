"""Replay for debugging: same events, original pacing, the SDK and CLI views, retention."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from websockets.asyncio.client import connect as ws_connect

from generator.model.loader import load_model
from generator.service.worker import GeneratorWorker
from producer import Producer
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe.streamindex import stream_ids
from tokenpipe.streams import StreamItem, last_batch, paced, submit
from tokenpipe.subjects import RELAY_OWNER, REQUESTS_STREAM, TOKENS_STREAM, token_subject
from tokenpipe.wire import Request, StreamMeta, TokenBatch
from tokenpipe_cli.natsserver import NatsServer

from .conftest import read_sse, start_relay, wait_until

BODY = {"prompt": "replay me", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "coalesce": {"max_tokens": 0}}


async def make_stream(http: httpx.AsyncClient, body: dict = BODY) -> tuple[str, list[tuple[str, str | None, str]]]:
    created = await http.post("/v1/streams", json=body)
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        return sid, await read_sse(resp)


async def timed_replay(http: httpx.AsyncClient, sid: str, speed: float) -> tuple[float, list]:
    t0 = time.perf_counter()
    async with http.stream("GET", f"/v1/streams/{sid}", params={"replay": "true", "speed": str(speed)}) as resp:
        events = await read_sse(resp)
    return time.perf_counter() - t0, events


async def test_replay_returns_the_same_events_with_original_pacing(http: httpx.AsyncClient) -> None:
    body = {**BODY, "max_tokens": 400}
    sid, live = await make_stream(http, body)
    emitted = [json.loads(d)["timings"]["emitted"] for e, _, d in live if e == "tokens"]
    original = (emitted[-1] - emitted[0]) / 1e9
    _, events = await timed_replay(http, sid, 0)
    assert events == live
    real, events = await timed_replay(http, sid, 1)
    assert events == live
    double, events = await timed_replay(http, sid, 2)
    assert events == live
    # How long the generation took (and so its replay) depends on the machine; pacing only ever
    # waits, so these lower bounds hold however busy it is. The arithmetic is pinned below.
    assert real >= 0.8 * original and double >= 0.8 * original / 2, (real, double, original)


async def test_paced_waits_the_recorded_gaps_divided_by_speed() -> None:
    """Recorded stamps (not a generation's pace): 10 gaps of 0.1 s."""
    batches = [TokenBatch(id="p", seq=i, index=i, token_ids=(i,), timings={"emitted": 10**18 + i * 10**8})
               for i in range(11)]

    async def source() -> AsyncIterator[StreamItem]:
        for b in batches:
            yield b

    async def elapsed(speed: float) -> float:
        t0 = time.perf_counter()
        assert [b async for b in paced(source(), speed)] == batches
        return time.perf_counter() - t0

    real, double, fast = await elapsed(1), await elapsed(2), await elapsed(0)
    # A sleep never ends early: the lower bounds are exact. The upper bounds tell the speeds apart
    # (and catch a gap slept twice) while leaving a busy machine ~0.4 s of stalls per replay.
    assert 0.95 <= real < 1.9, real
    assert 0.475 <= double < 0.9, double
    assert fast < 0.4, fast


async def test_sdk_replay_yields_the_live_batches(http: httpx.AsyncClient, settings: Settings) -> None:
    sid, live = await make_stream(http)
    async with await Producer.connect(settings=settings) as p:
        replayed = [b async for b in p.replay(sid, speed=0)]
        resumed = [b async for b in p.stream(sid, after_seq=9)]
    live_batches = [json.loads(d) for e, _, d in live if e == "tokens"]
    assert [(b.seq, b.index, list(b.token_ids), b.text) for b in replayed] == [
        (d["seq"], d["index"], d["token_ids"], d["text"]) for d in live_batches]
    assert replayed[-1].finish == "length"
    assert [b.seq for b in resumed] == [b.seq for b in replayed][10:]
    assert "".join(b.text for b in replayed) == "".join(json.loads(d)["text"] for e, _, d in live if e == "tokens")


async def test_cli_replay_json_and_streams_listing(http: httpx.AsyncClient, settings: Settings) -> None:
    sid, live = await make_stream(http)
    common = ["--nats-url", settings.nats_url, "--data-dir", settings.data_dir]
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tokenpipe_cli", "replay", "--jsonl",
                                                   "--speed", "0", "--from", "3", *common, "--", sid],
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    live_tokens = [json.loads(d) for e, _, d in live if e == "tokens"]
    assert [r["seq"] for r in rows] == [t["seq"] for t in live_tokens][3:]
    assert [r["token_ids"] for r in rows] == [t["token_ids"] for t in live_tokens][3:]
    assert rows[-1]["finish"] == "length" and "emitted" in rows[-1]["timings"]
    text = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tokenpipe_cli", "replay", "--speed",
                                                    "0", *common, "--", sid],
                                   capture_output=True, text=True, timeout=60)
    assert text.stdout.rstrip("\n") == "".join(t["text"] for t in live_tokens).rstrip("\n")
    listing = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tokenpipe_cli", "streams", "--limit",
                                                       "500", *common], capture_output=True, text=True, timeout=60,
                                      env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert listing.returncode == 0, listing.stderr
    line = next((ln for ln in listing.stdout.splitlines() if sid in ln), None)
    assert line is not None, listing.stdout
    assert "tiny-random" in line and "length" in line and " 60 " in line
    missing = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tokenpipe_cli", "replay", "nosuchstream",
                                                       *common], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr


async def test_streams_listing_left_out_a_kept_stream_while_the_bucket_was_read(settings: Settings) -> None:
    """``tokenpipe streams`` once listed through ``KeyValue.keys()``, whose watcher can say "done"
    before it has seen every key (on a loaded machine: "no keys" at all); a CI run's listing then
    lacked the stream just made. Every listing names every kept stream, writes going on or not."""
    bus = await connect(settings, name="listing-test", role="admin")
    kept = [Request.create("tiny-random", prompt="x").id for _ in range(30)]
    await asyncio.gather(*(bus.meta.put(i, StreamMeta(i, "t", "tiny-random", time.time_ns()).encode()) for i in kept))
    writing = True

    async def write_others() -> None:
        while writing:
            ids = [Request.create("tiny-random", prompt="x").id for _ in range(10)]
            await asyncio.gather(*(bus.meta.put(i, StreamMeta(i, "t", "tiny-random", time.time_ns()).encode())
                                   for i in ids))

    writer = asyncio.create_task(write_others())
    try:
        for _ in range(60):
            listed = set(await stream_ids(bus))
            assert not set(kept) - listed
            assert not any("." in i for i in listed)  # the tenants' index entries are not streams
    finally:
        writing = False
        await writer
        await bus.close()


async def test_expired_stream_is_404_saying_so(tmp_path: Path, data_dir: Path, settings: Settings) -> None:
    with NatsServer(tmp_path / "nats") as nats:
        short = settings.replace(nats_url=nats.url, token_max_age_s=1.0)
        bus = await connect(short, name="expiry-gen")
        worker = GeneratorWorker(short, load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir),
                                 bus)
        await worker.start()
        relay = await start_relay(short)
        try:
            async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
                sid, events = await make_stream(http, {**BODY, "max_tokens": 3})
                assert events[-1][0] == "done"

                async def gone() -> bool:
                    return await last_batch(bus, sid) is None

                await wait_until(gone, 30, "JetStream to age the batches out")
                r = await http.get(f"/v1/streams/{sid}")
                assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
        finally:
            await relay.stop()
            await worker.stop(drain_timeout=0.5)
            await bus.close()


async def _expect_expired(lines: AsyncIterator[str]) -> dict:
    """Read an SSE body up to its ``error`` event; its data."""
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event == "error":
            return json.loads(line.removeprefix("data: "))  # type: ignore[no-any-return]
    raise AssertionError("the stream ended without an error event")


async def test_wiped_history_is_404_expired_and_a_waiting_reader_ends_instead_of_pinging_forever(
        tmp_path: Path, data_dir: Path, settings: Settings) -> None:
    with NatsServer(tmp_path / "nats") as nats:
        quick = settings.replace(nats_url=nats.url, keepalive_s=0.3)
        bus = await connect(quick, name="wipe-gen")
        worker = GeneratorWorker(quick, load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir),
                                 bus)
        await worker.start()
        running = True
        relay = await start_relay(quick)
        try:
            async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
                # Finished, then its history removed (an admin purge): gone, however young.
                sid, events = await make_stream(http, {**BODY, "max_tokens": 3})
                assert events[-1][0] == "done"
                ended = time.time_ns()
                await bus.js.purge_stream(TOKENS_STREAM, subject=token_subject(RELAY_OWNER, sid))
                await wait_until(lambda: time.time_ns() - ended > 0.5e9, 10, "the stream to be older than keepalive")
                r = await http.get(f"/v1/streams/{sid}")
                assert r.status_code == 404, r.text
                assert r.json()["error"]["code"] == "expired" and "gone" in r.json()["error"]["message"]
                async with ws_connect(relay.url.replace("http://", "ws://") + "/v1/ws") as ws:
                    await ws.send(json.dumps({"type": "attach", "id": sid, "ref": 1}))
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    assert frame["type"] == "error" and frame["code"] == "expired" and frame["status"] == 404

                # Not yet stored is not gone: a request waiting in the queue (no generator now) keeps its
                # reader waiting, through pings, until its request leaves the queue unserved (here
                # purged, as request_max_age_s would): then the reader gets an error and the stream ends.
                await worker.stop(drain_timeout=0.5)
                running = False
                queued = Request.build("tiny-random", prompt="nobody serves me", params={"max_tokens": 3})
                await submit(bus, queued)
                async with http.stream("GET", f"/v1/streams/{queued.id}") as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    pings = 0
                    while pings < 4:  # > 1 s of waiting: every ping asked whether it is gone
                        line = await asyncio.wait_for(anext(lines), 30)
                        assert not line.startswith("event:"), line
                        pings += line == ": ping"
                    await bus.js.purge_stream(REQUESTS_STREAM)
                    error = await asyncio.wait_for(_expect_expired(lines), 30)
                    assert error["code"] == "expired", error
        finally:
            await relay.stop()
            if running:
                await worker.stop(drain_timeout=0.5)
            await bus.close()
