"""Streams that survive dead workers, drained workers, relay restarts and NATS restarts.

Real processes and real signals: nats-server, `tokenpipe generator` and `tokenpipe relay`
subprocesses; the client is httpx or the SDK in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from generator.model.loader import LoadedModel
from producer import Producer, aiter_sse
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe.subjects import ANNOUNCE_PREFIX
from tokenpipe.wire import Request
from tokenpipe_cli.launch import Child, free_port, http_ok, spawn_role, wait_ready
from tokenpipe_cli.natsserver import NatsServer

from .conftest import one_torch_thread, wait_until

pytestmark = pytest.mark.timeout(180)

LONG = {"prompt": "keep going", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
        "coalesce": {"max_tokens": 0}}


class Cluster:
    """nats-server + generator and relay subprocesses on free ports."""

    def __init__(self, tmp: Path, data_dir: Path, **env: Any) -> None:
        self.tmp = tmp
        self.nats = NatsServer(tmp / "nats")
        self.data_dir = data_dir
        self.env = {**os.environ, "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.3", "TOKENPIPE_ACK_WAIT_S": "2",
                    "TOKENPIPE_THREADS": "1", "TOKENPIPE_DTYPE": "float32", "TOKENPIPE_LOG_LEVEL": "INFO",
                    "TOKENPIPE_METRICS_PORT": "0",
                    **{f"TOKENPIPE_{k.upper()}": str(v) for k, v in env.items()}}
        self.relay_port = free_port()
        self.procs: list[Child] = []
        self.relay: Child | None = None
        self.announcements: dict[int, dict[str, Any]] = {}
        self.stream_id = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.relay_port}"

    def settings(self) -> Settings:
        return Settings.load(env={}, nats_url=self.nats.url, data_dir=str(self.data_dir))

    def _spawn(self, role: str, *args: str) -> Child:
        child = spawn_role(role, *args, "--nats-url", self.nats.url, "--data-dir", str(self.data_dir), env=self.env,
                           log=self.tmp / f"{role}-{len(self.procs)}.log")
        self.procs.append(child)
        return child

    def start_generator(self) -> Child:
        return self._spawn("generator", "--model", "tiny-random")

    def start_relay(self) -> Child:
        self.relay = self._spawn("relay", "--port", str(self.relay_port), "--model", "tiny-random")
        return self.relay

    async def watch(self) -> None:
        """Keep the latest announcement of every generator (pid, streams held)."""
        self.bus = await connect(self.settings(), name="test-watch")

        async def on(msg: Any) -> None:
            info = json.loads(msg.data)
            self.announcements[info["pid"]] = info

        await self.bus.nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=on)

    async def wait_generators(self, n: int) -> None:
        live = {p.pid for p in self.procs if p.returncode is None}
        await wait_until(lambda: len({pid for pid, a in self.announcements.items() if a["ready"] and pid in live}) >= n,
                    60, f"{n} generators")

    async def wait_relay(self) -> None:
        assert self.relay is not None
        await asyncio.to_thread(wait_ready, http_ok(self.url + "/readyz"), timeout=60, what="the relay",
                                children=[self.relay])

    def holder(self, stream_id: str) -> int | None:
        for pid, info in self.announcements.items():
            if stream_id in info.get("streams", ()):
                return pid
        return None

    async def close(self) -> None:
        for p in self.procs:
            p.kill()
        if hasattr(self, "bus"):
            await self.bus.close()
        self.nats.stop()


@pytest.fixture
async def cluster_factory(tmp_path: Path, data_dir: Path) -> AsyncIterator[Any]:
    made: list[Cluster] = []

    async def make(**env: Any) -> Cluster:
        c = Cluster(tmp_path, data_dir, **env)
        c.nats.start()
        await c.watch()
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def read_events(resp: httpx.Response, on_tokens: Any = None,
                      out: list[tuple[str, str | None, dict]] | None = None) -> list[tuple[str, str | None, dict]]:
    """SSE events up to done/error; ``out`` (if given) keeps what arrived even if the read fails."""
    out = [] if out is None else out
    async for ev in aiter_sse(resp):
        out.append((ev.event, ev.id, ev.json()))
        if ev.event == "tokens" and on_tokens is not None:
            await on_tokens(len([e for e in out if e[0] == "tokens"]))
        if ev.event in ("done", "error"):
            break
    return out


def signal_holder(c: Cluster, at_batch: int, sig: int, done: list[int]) -> Any:
    """An ``on_tokens`` callback: when the client has seen ``at_batch`` batches, send ``sig`` to
    the generator holding the stream (``c.stream_id``) and note its pid in ``done``."""

    async def on_tokens(n: int) -> None:
        if n == at_batch and not done:
            # The holder's next announcement names the stream.
            await wait_until(lambda: c.holder(c.stream_id) is not None, 30, "an announcement naming the holder")
            pid = c.holder(c.stream_id)
            assert pid is not None
            os.kill(pid, sig)
            done.append(pid)

    return on_tokens


async def stream_through(c: Cluster, body: dict[str, Any], on_tokens: Any) -> list[tuple[str, str | None, dict]]:
    async with httpx.AsyncClient(base_url=c.url, timeout=120) as http:
        c.stream_id = (await http.post("/v1/streams", json=body)).json()["id"]
        async with http.stream("GET", f"/v1/streams/{c.stream_id}") as resp:
            return await read_events(resp, on_tokens)


async def start(c: Cluster, generators: int) -> list[Child]:
    gens = [c.start_generator() for _ in range(generators)]
    c.start_relay()
    await c.wait_generators(generators)
    await c.wait_relay()
    return gens


def assert_contiguous(events: list[tuple[str, str | None, dict]], total: int) -> list[int]:
    tokens = [d for e, _, d in events if e == "tokens"]
    expected = 0
    for seq, d in enumerate(tokens):
        assert d["seq"] == seq, f"batch {seq} has seq {d['seq']}"
        assert d["index"] == expected, f"gap or duplicate at batch {seq}: index {d['index']} != {expected}"
        expected += len(d["token_ids"])
    assert expected == total
    return [t for d in tokens for t in d["token_ids"]]


def _greedy_ids(lm: LoadedModel, req: Request) -> list[int]:
    from generator.engine.runner import encode_prompt
    from generator.engine.scheduler import Engine

    with one_torch_thread():
        engine = Engine(lm, max_batch=1)
        seq = engine.new_sequence("r", encode_prompt(lm.tokenizer, req), req.params)
        engine.add(seq)
        engine.run_to_completion()
    return seq.generated


async def test_kill9_mid_stream_continues_on_another_worker(cluster_factory: Any, tiny_model: LoadedModel) -> None:
    c = await cluster_factory()
    await start(c, generators=2)
    killed: list[int] = []
    events = await stream_through(c, LONG, signal_holder(c, 40, signal.SIGKILL, killed))
    assert killed, "the stream finished before a worker could be killed"
    assert events[-1][0] == "done" and events[-1][2]["finish"] == "length", events[-1]
    assert events[-1][2]["usage"]["completion_tokens"] == 1500
    ids = assert_contiguous(events, 1500)
    assert ids == _greedy_ids(tiny_model, Request.from_map({"v": 1, "id": "r", "model": "tiny-random",
                                                            "prompt": LONG["prompt"], "params": LONG}))
    survivor = [pid for pid, info in c.announcements.items() if pid not in killed and info["ready"]]
    assert survivor


async def test_sigterm_drains_and_hands_back_to_another_worker(cluster_factory: Any) -> None:
    c = await cluster_factory(drain_timeout_s=0.2)
    gens = await start(c, generators=2)
    drained: list[int] = []
    events = await stream_through(c, LONG, signal_holder(c, 40, signal.SIGTERM, drained))
    assert drained
    assert events[-1][0] == "done" and events[-1][2]["finish"] == "length"
    assert_contiguous(events, 1500)
    stopped = next(p for p in gens if p.pid == drained[0])
    assert stopped.proc.wait(30) == 0  # a clean exit after handing the request back


async def test_exhausted_deliveries_end_the_stream_with_an_error(cluster_factory: Any) -> None:
    c = await cluster_factory(max_deliver=1)
    await start(c, generators=2)
    killed: list[int] = []
    events = await stream_through(c, LONG, signal_holder(c, 20, signal.SIGKILL, killed))
    assert killed
    assert events[-1][0] == "error"
    assert "attempted 1 times" in events[-1][2]["message"]
    tokens = [d for e, _, d in events if e == "tokens"]
    assert len(tokens) >= 20


async def test_relay_restart_then_resume_with_last_event_id(cluster_factory: Any) -> None:
    c = await cluster_factory()
    c.start_generator()
    relay = c.start_relay()
    await c.wait_generators(1)
    await c.wait_relay()
    body = {**LONG, "max_tokens": 800}
    async with httpx.AsyncClient(base_url=c.url, timeout=120) as http:
        sid = (await http.post("/v1/streams", json=body)).json()["id"]
        first: list[tuple[str, str | None, dict]] = []

        async def kill_relay(n: int) -> None:
            if n == 25:
                relay.kill()

        with pytest.raises(httpx.HTTPError):  # the relay died under the open stream
            async with http.stream("GET", f"/v1/streams/{sid}") as resp:
                await read_events(resp, kill_relay, first)
        assert 25 <= len([e for e in first if e[0] == "tokens"]) < 800
        c.start_relay()
        await c.wait_relay()
        last = first[-1][1]
        async with http.stream("GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": str(last)}) as resp:
            rest = await read_events(resp)
    events = [e for e in first if e[0] == "tokens"] + rest
    assert events[-1][0] == "done" and events[-1][2]["finish"] == "length"
    assert_contiguous(events, 800)


async def test_nats_restart_keeps_queued_requests(cluster_factory: Any) -> None:
    c = await cluster_factory()
    settings = c.settings()
    async with await Producer.connect(settings=settings) as producer:
        handles = [await producer.submit("tiny-random", prompt=f"queued {i}", max_tokens=10, temperature=0,
                                         ignore_eos=True) for i in range(3)]
    await c.bus.close()
    c.nats.stop()
    c.nats.start()  # same port, same JetStream directory
    await c.watch()
    c.start_generator()
    async with await Producer.connect(settings=settings) as producer:
        results = await asyncio.wait_for(asyncio.gather(*(producer.stream(h.id).result() for h in handles)), 60)
    assert [r.finish for r in results] == ["length"] * 3
    assert all(r.usage is not None and r.usage.completion_tokens == 10 for r in results)


async def test_nats_restart_mid_stream_loses_no_batch(cluster_factory: Any) -> None:
    c = await cluster_factory()
    await start(c, generators=1)
    restarted: list[bool] = []

    async def bounce(n: int) -> None:
        if n == 30 and not restarted:
            c.nats.stop()
            c.nats.start()
            restarted.append(True)

    events = await asyncio.wait_for(stream_through(c, {**LONG, "max_tokens": 1200}, bounce), 90)
    assert restarted
    # Batches lost in the outage are republished (deduplicated by Msg-Id) and put back in order.
    assert events[-1][0] == "done", events[-1]
    assert_contiguous(events, 1200)
