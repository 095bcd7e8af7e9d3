"""The stream inspector's API: ``GET /v1/streams`` (per tenant, newest first, paginated, filtered)
and ``GET /v1/streams/{id}/export`` (one stream as one document), against the real pipeline with
API keys for two tenants; and the export format's arithmetic on recorded timings."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from generator.service.worker import GeneratorWorker
from tokenpipe.settings import Settings
from tokenpipe.streamindex import index_key, tenant_token
from tokenpipe.streamrecord import FORMAT, StreamRecord, build, summarize
from tokenpipe.wire import StreamMeta, TokenBatch

from .conftest import RelayServer, read_sse, start_relay

# Tenants no other test module uses: the session's NATS (and so the index) is shared.
ALICE, BOB = "key-insp-alice", "key-insp-bob"
BODY = {"prompt": "inspect me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def keyed(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[RelayServer]:
    relay = await start_relay(settings.replace(api_keys=f"{ALICE}:insp-alice,{BOB}:insp-bob", max_streams_per_key=8),
                              ready_headers=auth(ALICE))
    yield relay
    await relay.stop()


@pytest.fixture
async def client(keyed: RelayServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
        yield http


async def run_stream(http: httpx.AsyncClient, key: str, body: dict[str, Any] = BODY) -> tuple[str, list[dict]]:
    """Create a stream and read it to its end; its ``tokens`` events and the last event's data."""
    created = await http.post("/v1/streams", headers=auth(key), json=body)
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    async with http.stream("GET", f"/v1/streams/{sid}", headers=auth(key)) as resp:
        events = [(e, json.loads(d)) for e, _, d in await read_sse(resp)]
    return sid, [d for e, d in events if e == "tokens"] + [events[-1][1]]


async def listing(http: httpx.AsyncClient, key: str, **params: Any) -> httpx.Response:
    return await http.get("/v1/streams", headers=auth(key), params=params)


async def test_each_tenant_lists_only_its_own_streams_newest_first(client: httpx.AsyncClient) -> None:
    mine = [(await run_stream(client, ALICE, {**BODY, "max_tokens": 5 + i}))[0] for i in range(3)]
    theirs, _ = await run_stream(client, BOB)
    r = await listing(client, ALICE, limit=100)
    assert r.status_code == 200, r.text
    page = r.json()
    ids = [s["id"] for s in page["data"]]
    assert ids[:3] == mine[::-1]  # newest first
    assert theirs not in ids
    created = [s["created_ns"] for s in page["data"]]
    assert created == sorted(created, reverse=True)
    newest = page["data"][0]
    assert newest["model"] == "tiny-random" and newest["status"] == "finished" and newest["finish"] == "length"
    assert newest["tokens"] == 7 and newest["batches"] >= 1
    assert 0 < newest["ttft_ms"] <= newest["duration_ms"]
    bob = (await listing(client, BOB, limit=100)).json()["data"]
    assert theirs in [s["id"] for s in bob] and not set(mine) & {s["id"] for s in bob}


async def test_pages_follow_one_another_and_a_foreign_cursor_is_404(client: httpx.AsyncClient) -> None:
    for _ in range(3):
        await run_stream(client, ALICE)
    everything = [s["id"] for s in (await listing(client, ALICE, limit=100)).json()["data"]]
    assert len(everything) >= 3
    first = (await listing(client, ALICE, limit=2)).json()
    assert [s["id"] for s in first["data"]] == everything[:2]
    assert first["has_more"] is True and first["next_before"] == everything[1]
    second = (await listing(client, ALICE, limit=2, before=first["next_before"])).json()
    assert [s["id"] for s in second["data"]] == everything[2:4]
    # Bob's stream as alice's cursor: the very same 404 as an id that never existed.
    theirs, _ = await run_stream(client, BOB)
    foreign = await listing(client, ALICE, before=theirs)
    unknown = await listing(client, ALICE, before="neverexisted")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == "stream_not_found"
    assert foreign.json()["error"]["message"].replace(theirs, "neverexisted") == unknown.json()["error"]["message"]
    for bad in ({"limit": 0}, {"limit": 101}, {"before": "a.b"}, {"model": "x y"}, {"finish": "maybe"}):
        r = await listing(client, ALICE, **bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_request"


async def test_filters_by_model_and_finish(client: httpx.AsyncClient) -> None:
    done, _ = await run_stream(client, ALICE)
    created = await client.post("/v1/streams", headers=auth(ALICE),
                                json={**BODY, "max_tokens": 2000, "coalesce": {"max_tokens": 0}})
    cancelled = created.json()["id"]
    async with client.stream("GET", f"/v1/streams/{cancelled}", headers=auth(ALICE)) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("event: tokens"):
                break  # it is running: cancel it
    assert (await client.delete(f"/v1/streams/{cancelled}", headers=auth(ALICE))).status_code == 200
    async with client.stream("GET", f"/v1/streams/{cancelled}", headers=auth(ALICE)) as resp:
        assert json.loads((await read_sse(resp))[-1][2])["finish"] == "cancelled"
    only = (await listing(client, ALICE, finish="cancelled", limit=100)).json()["data"]
    assert cancelled in [s["id"] for s in only] and done not in [s["id"] for s in only]
    assert {s["finish"] for s in only} == {"cancelled"}
    length = [s["id"] for s in (await listing(client, ALICE, finish="length", limit=100)).json()["data"]]
    assert done in length and cancelled not in length
    assert done in [s["id"] for s in (await listing(client, ALICE, model="tiny-random", limit=100)).json()["data"]]
    assert (await listing(client, ALICE, model="no-such-model")).json() == {
        "object": "list", "data": [], "has_more": False, "next_before": None}


async def test_export_is_the_stream_as_read_and_the_request(client: httpx.AsyncClient, settings: Settings,
                                                            generator: GeneratorWorker) -> None:
    body = {**BODY, "max_tokens": 9, "coalesce": {"max_tokens": 2, "max_delay_ms": 50}}
    sid, events = await run_stream(client, ALICE, body)
    tokens, done = events[:-1], events[-1]
    r = await client.get(f"/v1/streams/{sid}/export", headers=auth(ALICE))
    assert r.status_code == 200, r.text
    assert f"tokenpipe-stream-{sid}.json" in r.headers["content-disposition"]
    record = r.json()
    StreamRecord.model_validate(record)
    assert record["format"] == FORMAT and record["id"] == sid and record["model"] == "tiny-random"
    assert [b["token_ids"] for b in record["batches"]] == [t["token_ids"] for t in tokens]
    assert "".join(b["text"] for b in record["batches"]) == "".join(t["text"] for t in tokens)
    assert [b["timings"] for b in record["batches"]] == [t["timings"] for t in tokens]
    assert record["batches"][-1]["finish"] == done["finish"] == "length"
    assert record["gaps"] == []
    request = record["request"]
    assert request["prompt"] == "inspect me" and request["params"]["max_tokens"] == 9
    assert request["coalesce"] == {"max_tokens": 2, "max_delay_ms": 50.0}
    assert "tenant" not in request
    assert record["summary"]["tokens"] == 9 and record["summary"]["batches"] == len(tokens)
    assert record["summary"]["served_by"] == [generator.worker_id]  # which generator served it (issue 47)
    assert record["trace_id"] is None or len(record["trace_id"]) == 32
    # Bob cannot export it: the same 404 as for a stream that never existed.
    theirs = await client.get(f"/v1/streams/{sid}/export", headers=auth(BOB))
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "stream_not_found"
    # `tokenpipe replay --json` writes the same document. ("--" first: an id may begin with "-".)
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tokenpipe_cli", "replay", "--json",
                                                   "--nats-url", settings.nats_url, "--data-dir", settings.data_dir,
                                                   "--", sid],
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == record


def test_index_keys_sort_by_creation_and_hide_the_tenant_name() -> None:
    older, newer = index_key("a b/c", 5, "m", "id1"), index_key("a b/c", 40, "m", "id0")
    assert older < newer and "a b/c" not in older and tenant_token("a b/c") in older
    assert tenant_token("alice") != tenant_token("bob")


def _batch(seq: int, index: int, n: int, **timings: int) -> TokenBatch:
    return TokenBatch(id="s", seq=seq, index=index, token_ids=tuple(range(n)), text="x" * n, timings=timings,
                      finish="length" if seq == 3 else None)


def test_summary_arithmetic_from_recorded_timings() -> None:
    ms = 1_000_000
    batches = [_batch(0, 0, 1, created=0, received=2 * ms, admitted=5 * ms, first_token=15 * ms, emitted=16 * ms),
               _batch(1, 1, 4, first_token=20 * ms, emitted=32 * ms),
               _batch(2, 5, 4, first_token=36 * ms, emitted=48 * ms),
               _batch(3, 9, 2, first_token=52 * ms, emitted=60 * ms)]
    s = summarize(0, batches)
    assert (s.queue_ms, s.admission_ms, s.prefill_ms, s.ttft_ms, s.duration_ms) == (2, 3, 10, 16, 60)
    assert s.tokens == 11 and s.batches == 4 and s.finish == "length"
    assert s.tokens_per_s == round(10 / 0.044, 2)
    # token gaps: 5 ms (batch 0's one token), 4 ms x 4 (batch 1), 4 ms x 4 (batch 2)
    assert s.itl_p50_ms == 4 and s.itl_p99_ms == 5
    # a missing batch is a gap in the record, and no inter-token estimate spans it
    record = build(StreamMeta("s", "t", "m", 0), {b.seq: b for b in batches if b.seq != 2})
    assert [g.model_dump() for g in record.gaps] == [{"from_seq": 2, "to_seq": 2}]
    assert record.summary.itl_p99_ms == 5 and record.summary.tokens == 11
