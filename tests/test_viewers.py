"""Viewers are not owners: a reader's disconnect cancels a generation only when it was the last
live reader of a running stream on every relay and nobody re-attached within the grace.

Two real relays share one nats-server (and the one tiny generator); readers are real SSE
clients. Readers close after their first event, so whether the others still get every token
does not depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from generator.service.worker import GeneratorWorker
from producer import aiter_sse
from tokenpipe.bus import Bus
from tokenpipe.settings import Settings
from tokenpipe.streams import follow
from tokenpipe.wire import TokenBatch

from .conftest import RelayServer, start_relay, wait_until

GRACE_S = 0.5
LONG = {"prompt": "keep going", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
        "coalesce": {"max_tokens": 1}}


@pytest.fixture(scope="module")
async def relays(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[tuple[RelayServer, RelayServer]]:
    viewer = settings.replace(cancel_grace_s=GRACE_S)
    a = await start_relay(viewer)
    b = await start_relay(viewer)
    yield a, b
    await a.stop()
    await b.stop()


class Reader:
    """One SSE reader of a stream; ``first`` is set once it saw its first event; ``close()``
    hangs up; otherwise it reads to the end."""

    def __init__(self, relay: RelayServer, sid: str, **params: str) -> None:
        self.relay, self.sid, self.params = relay, sid, params
        self.first = asyncio.Event()
        self.hang_up = asyncio.Event()
        self.events: list[tuple[str, dict]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.relay.url, timeout=60) as http, \
                http.stream("GET", f"/v1/streams/{self.sid}", params=self.params) as resp:
            assert resp.status_code == 200
            async for event in aiter_sse(resp):
                self.events.append((event.event, json.loads(event.data)))
                self.first.set()
                if self.hang_up.is_set() or event.event in ("done", "error"):
                    return

    async def close(self) -> None:
        self.hang_up.set()
        await self.task

    async def finish(self) -> tuple[list[int], dict]:
        await asyncio.wait_for(self.task, 120)
        tokens = [t for name, data in self.events if name == "tokens" for t in data["token_ids"]]
        assert self.events[-1][0] == "done", self.events[-1]
        return tokens, self.events[-1][1]


async def create(relay: RelayServer, **overrides: object) -> str:
    async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
        r = await http.post("/v1/streams", json={**LONG, **overrides})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


async def final_batch(bus: Bus, sid: str) -> TokenBatch:
    finals = [b async for b in follow(bus, sid) if isinstance(b, TokenBatch) and b.is_final]
    return finals[0]


async def first_readers_leave_others_get_everything(relays: tuple[RelayServer, RelayServer],
                                                    placement: list[int]) -> None:
    sid = await create(relays[0])
    readers = [Reader(relays[i], sid) for i in placement]
    await asyncio.wait_for(asyncio.gather(*(r.first.wait() for r in readers)), 60)
    await readers[0].close()  # the creator's relay loses its (first) reader mid-stream
    await asyncio.sleep(GRACE_S * 3)  # past the grace: a wrong cancel would have been sent by now
    results = [await r.finish() for r in readers[1:]]
    for tokens, done in results:
        assert done["finish"] == "length", done
        assert len(tokens) == LONG["max_tokens"] and done["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert all(tokens == results[0][0] for tokens, _ in results)


async def test_regression_one_viewer_leaving_cancelled_every_viewer_two_readers_two_relays(
        relays: tuple[RelayServer, RelayServer]) -> None:
    await first_readers_leave_others_get_everything(relays, [0, 1])


async def test_three_readers_first_leaves_others_get_every_token(relays: tuple[RelayServer, RelayServer]) -> None:
    await first_readers_leave_others_get_everything(relays, [0, 0, 1])


async def test_second_reader_on_the_same_relay_keeps_the_stream(relays: tuple[RelayServer, RelayServer]) -> None:
    await first_readers_leave_others_get_everything(relays, [0, 0])


async def test_last_reader_leaving_cancels_after_the_grace(relays: tuple[RelayServer, RelayServer],
                                                           bus: Bus) -> None:
    # Far more tokens than any machine makes within the grace after the readers leave.
    sid = await create(relays[0], max_tokens=4000)
    readers = [Reader(relays[0], sid), Reader(relays[1], sid)]
    await asyncio.wait_for(asyncio.gather(*(r.first.wait() for r in readers)), 60)
    for r in readers:
        await r.close()
    final = await asyncio.wait_for(final_batch(bus, sid), 60)
    assert final.finish == "cancelled"
    assert final.usage is not None and final.usage.completion_tokens < 4000


async def test_reconnect_within_the_grace_continues_the_stream(relays: tuple[RelayServer, RelayServer]) -> None:
    sid = await create(relays[0])
    first = Reader(relays[0], sid)
    await asyncio.wait_for(first.first.wait(), 60)
    await first.close()
    last_seq = max(data["seq"] for name, data in first.events if name == "tokens")
    # Re-attach (on the other relay) with Last-Event-ID well within the grace.
    again = Reader(relays[1], sid, last_event_id=str(last_seq))
    tokens, done = await again.finish()
    assert done["finish"] == "length"
    seen = [t for name, data in first.events if name == "tokens" for t in data["token_ids"]]
    assert len(seen) + len(tokens) == LONG["max_tokens"]


async def test_a_replay_is_not_a_reader_and_never_cancels(relays: tuple[RelayServer, RelayServer],
                                                          bus: Bus) -> None:
    sid = await create(relays[0])
    replay = Reader(relays[1], sid, replay="true", speed="1")
    await asyncio.wait_for(replay.first.wait(), 60)
    await replay.close()
    assert relays[1].app.state.relay.forwarder.readers[sid] == 0
    final = await asyncio.wait_for(final_batch(bus, sid), 120)
    assert final.finish == "length"


async def test_delete_by_the_owner_cancels_whoever_is_reading(relays: tuple[RelayServer, RelayServer]) -> None:
    # Long enough that no busy machine finishes it between the readers' first token and the DELETE.
    sid = await create(relays[0], max_tokens=4000)
    readers = [Reader(relays[0], sid), Reader(relays[1], sid)]
    await asyncio.wait_for(asyncio.gather(*(r.first.wait() for r in readers)), 60)
    async with httpx.AsyncClient(base_url=relays[1].url, timeout=30) as http:
        assert (await http.delete(f"/v1/streams/{sid}")).status_code == 200
    for r in readers:
        _, done = await r.finish()
        assert done["finish"] == "cancelled"


async def test_readers_are_counted_per_stream_and_released(relays: tuple[RelayServer, RelayServer]) -> None:
    sid = await create(relays[0])
    reader = Reader(relays[1], sid)
    forwarder = relays[1].app.state.relay.forwarder
    await asyncio.wait_for(reader.first.wait(), 60)
    assert forwarder.readers[sid] == 1
    await reader.finish()
    await wait_until(lambda: sid not in forwarder.readers, 10, "the reader to be released")
