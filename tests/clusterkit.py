"""A real 3-node JetStream cluster with generators and relays under load, for the cluster tests.

Three nats-server processes on loopback (:class:`tokenpipe_cli.cluster.LocalCluster`, R3 streams),
``tokenpipe generator`` and ``tokenpipe relay`` subprocesses given the cluster's seed list, and
:class:`Load`: a fixed number of native-API streams kept in flight over both relays while a
test breaks the cluster. :func:`verify` checks every stream the way a client would (served,
ended with ``done``, contiguous, no batch twice, the same tokens as an undisturbed greedy run)
and measures what the fault cost (lost requests and batches, the longest stall).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from generator.model.loader import LoadedModel
from producer import aiter_sse
from tokenpipe.bus import Bus, connect
from tokenpipe.errors import TokenpipeError
from tokenpipe.settings import Settings
from tokenpipe.streamrecord import SERVED_BY_HEADER
from tokenpipe.subjects import (
    ANNOUNCE_PREFIX,
    META_BUCKET,
    RELAY_OWNER,
    REQUESTS_STREAM,
    TOKEN_WILDCARD,
    TOKENS_STREAM,
    token_subject,
)
from tokenpipe.wire import Request, TokenBatch
from tokenpipe_cli.cluster import LocalCluster
from tokenpipe_cli.launch import die_with_parent, free_port

from .conftest import one_torch_thread, wait_until

STREAMS = (REQUESTS_STREAM, TOKENS_STREAM, f"KV_{META_BUCKET}")
PROMPTS = tuple(f"cluster check {i}: keep counting" for i in range(4))
MAX_TOKENS = 160


class Stack:
    """The cluster and the role processes; ``restore()`` makes it whole again between tests."""

    def __init__(self, tmp: Path, data_dir: Path, *, generators: int = 2, relays: int = 2, **env: Any) -> None:
        self.tmp = tmp
        self.data_dir = data_dir
        self.cluster = LocalCluster(tmp / "nats", 3)
        self.n_generators = generators
        self.n_relays = relays
        self.env = {**os.environ, "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.3", "TOKENPIPE_THREADS": "1",
                    "TOKENPIPE_DTYPE": "float32", "TOKENPIPE_LOG_LEVEL": "INFO", "TOKENPIPE_METRICS_PORT": "0",
                    "TOKENPIPE_MAX_BATCH": "16",
                    **{f"TOKENPIPE_{k.upper()}": str(v) for k, v in env.items()}}
        self.relay_ports = [free_port() for _ in range(relays)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.generators: list[subprocess.Popen[bytes]] = []
        self.relays: dict[int, subprocess.Popen[bytes]] = {}  # the current process of each relay
        self.announcements: dict[int, dict[str, Any]] = {}
        self.bus: Bus | None = None

    @property
    def relay_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.relay_ports]

    def settings(self) -> Settings:
        return Settings.load(env={}, nats_url=self.cluster.url, data_dir=str(self.data_dir))

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{args[0]}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen([sys.executable, "-m", "tokenpipe_cli", *args, "--nats-url", self.cluster.url,
                                 "--data-dir", str(self.data_dir)], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.procs.append(proc)
        return proc

    async def start(self) -> Stack:
        await asyncio.to_thread(self.cluster.start)
        # The watcher provisions the R3 streams first, so the roles start on a settled cluster.
        self.bus = await connect(self.settings(), name="test-cluster-watch")

        async def on(msg: Any) -> None:
            info = json.loads(msg.data)
            self.announcements[info["pid"]] = info

        await self.bus.nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=on)
        for _ in range(self.n_generators):
            self.generators.append(self._spawn("generator", "--model", "tiny-random"))
        for i in range(self.n_relays):
            self.start_relay(i)
        await self.wait_roles()
        # Warm up both generators (first prefills, allocations), so no test times a cold start.
        warm = Load(self.relay_urls, concurrency=16, max_tokens=4).start()
        await warm.wait_streams(16)
        await warm.stop()
        return self

    def start_relay(self, i: int) -> subprocess.Popen[bytes]:
        proc = self._spawn("relay", "--port", str(self.relay_ports[i]), "--model", "tiny-random")
        self.relays[i] = proc
        return proc

    async def wait_roles(self) -> None:
        live = {p.pid for p in self.procs if p.poll() is None}
        try:
            await wait_until(lambda: len({pid for pid, a in self.announcements.items()
                                          if a["ready"] and pid in live}) >= self.n_generators, 90, "generators")
        except AssertionError as exc:  # say why: each generator's exit status and its log's tail
            raise AssertionError(f"{exc}\n{self.generator_logs()}") from None

        async def relays_ready() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return all([(await c.get(u + "/readyz")).status_code == 200 for u in self.relay_urls])
            except httpx.HTTPError:
                return False

        await wait_until(relays_ready, 90, "relays ready")

    def generator_log_lines(self) -> list[tuple[str, subprocess.Popen[bytes], list[str]]]:
        """Each generator's name (``generator-<i>``, as its log file), process and log lines."""
        out = []
        for proc in self.generators:
            name = f"generator-{self.procs.index(proc)}"
            out.append((name, proc, (self.tmp / f"{name}.log").read_text(errors="replace").splitlines()))
        return out

    def generator_logs(self, lines: int = 15) -> str:
        return "\n".join(f"{name} (pid {proc.pid}, exit {proc.poll()}):\n" + "\n".join(log[-lines:])
                         for name, proc, log in self.generator_log_lines())

    def roles_alive(self) -> bool:
        return all(p.poll() is None for p in [*self.generators, *self.relays.values()])

    async def replicas_current(self) -> bool:
        """Every stream has a leader and all its replicas caught up."""
        assert self.bus is not None
        for name in STREAMS:
            try:
                info = await self.bus.js.stream_info(name)
            except Exception:  # mid-election: not current yet
                return False
            cl = info.cluster
            wanted = (info.config.num_replicas or 1) - 1
            if cl is None or not cl.leader or len(cl.replicas or ()) != wanted or not all(
                    r.current and not r.offline for r in cl.replicas or ()):
                return False
        return True

    async def restore(self) -> None:
        """Every node running and thawed, healthy, every stream with all replicas current."""
        for i in range(len(self.cluster.nodes)):
            if self.cluster.running(i):
                self.cluster.thaw(i)
            else:
                await asyncio.to_thread(self.cluster.start_node, i)
        await asyncio.to_thread(self.cluster.wait_healthy, 60.0)
        await wait_until(self.replicas_current, 60, "every stream's replicas current")

    async def stored_counts(self) -> dict[str, int]:
        """Messages stored per token subject (``tp.tok.relay.<id>`` → count)."""
        assert self.bus is not None
        info = await self.bus.js.stream_info(TOKENS_STREAM, subjects_filter=TOKEN_WILDCARD)
        return dict(info.state.subjects or {})

    async def stored_when_settled(self, outcomes: list[Outcome], timeout: float = 30.0) -> dict[str, int]:
        """The stored counts once every finished stream's batches are all in JetStream (generators
        keep republishing what an outage refused, behind the clients that got it live), or as
        they are after ``timeout``."""
        want = {token_subject(RELAY_OWNER, o.id): int(o.events[-1][2] or 0) + 1 for o in outcomes
                if o.id and o.events and o.events[-1][1] == "done"}
        deadline = time.monotonic() + timeout
        while True:
            counts = await self.stored_counts()
            if all(counts.get(k, 0) >= n for k, n in want.items()) or time.monotonic() > deadline:
                return counts
            await asyncio.sleep(0.2)  # polling JetStream's counts; no event says "all stored"

    async def explain(self, outcomes: list[Outcome], problems: list[str], limit: int = 3) -> str:
        """For a failure message: each stream named in ``problems`` (at most ``limit``) as its client
        saw it beside every message stored on its subject (duplicates included) and the generators'
        log lines that name it: which writer wrote which batch, and who continued where."""
        assert self.bus is not None
        named = [o for o in outcomes if o.id and any(p.startswith(f"{o.id}:") for p in problems)][:limit]
        out = []
        for o in named:
            rid = o.id or ""
            seen = [f"{d['seq']}@{d['index']}+{len(d['token_ids'])}{'*' if 'received' in d['timings'] else ''}"
                    for _, e, _, d in o.events if e == "tokens"]
            out.append(f"{rid} as its client saw it (seq@index+tokens, * a delivery's first batch): {' '.join(seen)}")
            try:
                sub = await self.bus.js.subscribe(token_subject(RELAY_OWNER, rid), ordered_consumer=True)
                try:
                    while True:
                        msg = await sub.next_msg(timeout=5.0)
                        try:
                            b = TokenBatch.decode(msg.data)
                            what = f"batch {b.seq}@{b.index}+{len(b.token_ids)} final={b.is_final}"
                        except TokenpipeError:
                            what = f"not a batch: {msg.data[:60]!r}"
                        h = msg.headers or {}
                        out.append(f"  stored #{msg.metadata.sequence.stream}: {what} msg-id {h.get('Nats-Msg-Id')} "
                                   f"served-by {h.get(SERVED_BY_HEADER)}")
                        if msg.metadata.num_pending == 0:
                            break
                finally:
                    await sub.unsubscribe()
            except Exception as exc:  # a diagnosis must not hide the failure it explains
                out.append(f"  stored: not read ({exc!r})")
            for name, _, lines in self.generator_log_lines():
                out.extend(f"  {name}: {line[:400]}" for line in lines if rid in line)
        return "\n".join(out)

    def roles_on(self, node: int) -> dict[str, int]:
        """How many relay and generator connections node ``node`` serves now (its /connz)."""
        conns = self.cluster.monitor(node, "/connz?limit=1024").get("connections") or []
        names = [c.get("name") or "" for c in conns]
        return {"relays": sum(n == "tokenpipe-relay" for n in names),
                "generators": sum(n.startswith("tokenpipe-generator") for n in names)}

    async def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self.bus is not None:
            await self.bus.close()
        await asyncio.to_thread(self.cluster.stop)


@dataclass
class Outcome:
    """One client's stream, as the client saw it."""

    relay: int
    prompt: int
    started: float
    id: str | None = None
    status: int | None = None
    post_s: float = 0.0
    events: list[tuple[float, str, str | None, dict[str, Any]]] = field(default_factory=list)  # t, event, id, data
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Its last event ended the stream (``done`` or ``error``)."""
        return bool(self.events) and self.events[-1][1] in ("done", "error")


def body(prompt: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"prompt": PROMPTS[prompt], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def read_stream(http: httpx.AsyncClient, out: Outcome, headers: dict[str, str] | None = None) -> None:
    """Append ``out``'s SSE events (arrival time, event, id, data) until ``done`` or ``error``."""
    async with http.stream("GET", f"/v1/streams/{out.id}", headers=headers) as resp:
        if resp.status_code != 200:
            out.error = f"GET {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for ev in aiter_sse(resp):
            out.events.append((time.monotonic(), ev.event, ev.id, ev.json()))
            if ev.event in ("done", "error"):
                return


async def one_stream(http: httpx.AsyncClient, relay: int, prompt: int, max_tokens: int = MAX_TOKENS,
                     out: Outcome | None = None) -> Outcome:
    """POST a stream and read it to its end, into ``out`` (a new :class:`Outcome` if not given)."""
    out = out if out is not None else Outcome(relay, prompt, time.monotonic())
    try:
        resp = await http.post("/v1/streams", json=body(prompt, max_tokens))
        out.post_s = time.monotonic() - out.started
        out.status = resp.status_code
        if resp.status_code != 201:
            out.error = f"POST {resp.status_code}: {resp.text[:200]}"
            return out
        out.id = resp.json()["id"]
        await read_stream(http, out)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


class Load:
    """``concurrency`` streams kept in flight, alternating between the relays, until :meth:`stop`."""

    def __init__(self, relay_urls: list[str], concurrency: int = 16, max_tokens: int = MAX_TOKENS) -> None:
        self.clients = [httpx.AsyncClient(base_url=u, timeout=120) for u in relay_urls]
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]
        return self

    async def _worker(self, i: int) -> None:
        while not self._stopping.is_set():
            self._n += 1
            relay = i % len(self.clients)
            out = Outcome(relay, self._n % len(PROMPTS), time.monotonic())
            self.outcomes.append(out)  # before it ends: a stream that hangs is reported by stop()
            await one_stream(self.clients[relay], relay, out.prompt, self.max_tokens, out)

    async def submit(self, relay: int, prompt: int) -> Outcome:
        """One more stream beside the load (the caller decides when)."""
        out = Outcome(relay, prompt, time.monotonic())
        self.outcomes.append(out)
        return await one_stream(self.clients[relay], relay, prompt, self.max_tokens, out)

    def done_streams(self) -> int:
        return sum(1 for o in self.outcomes if o.finished)

    async def wait_streams(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` more streams than now have finished (the load is really flowing)."""
        target = self.done_streams() + n
        await wait_until(lambda: self.done_streams() >= target, timeout, f"{n} streams to finish")

    async def stop(self, timeout: float = 120.0) -> list[Outcome]:
        """No new streams; the ones in flight run to their end."""
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)
        except TimeoutError:
            raise AssertionError(f"streams still open after {timeout:g} s: " + "; ".join(self.open_streams())) from None
        finally:
            for c in self.clients:
                await c.aclose()
        return self.outcomes

    def open_streams(self) -> list[str]:
        """The streams not ended, each with where it stopped (for a failure message)."""
        now = time.monotonic()
        return [f"{o.id or '(POST)'} via relay {o.relay}: {len(o.events)} events, last "
                f"{o.events[-1][1:3] if o.events else None}, "
                f"{now - (o.events[-1][0] if o.events else o.started):.1f} s ago"
                for o in self.outcomes if not o.finished and o.error is None]


def greedy_reference(lm: LoadedModel, max_tokens: int = MAX_TOKENS, prompts: int = len(PROMPTS)) -> list[list[int]]:
    """What an undisturbed greedy run produces for the first ``prompts`` of :data:`PROMPTS` (the
    engine in-process)."""
    from generator.engine.runner import encode_prompt
    from generator.engine.scheduler import Engine
    from tokenpipe.wire import SamplingParams

    with one_torch_thread():  # as the stack's generators run
        engine = Engine(lm, max_batch=len(PROMPTS))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seqs = []
        for i, text in enumerate(PROMPTS[:prompts]):
            req = Request.from_map({"v": 1, "id": f"ref{i}", "model": "tiny-random", "prompt": text,
                                    "params": params.to_map()})
            seqs.append(engine.new_sequence(req.id, encode_prompt(lm.tokenizer, req), params))
            engine.add(seqs[-1])
        engine.run_to_completion()
    return [list(s.generated) for s in seqs]


@dataclass
class Report:
    scenario: str
    requests: int = 0
    lost_requests: int = 0
    lost_batches: int = 0
    duplicated_batches: int = 0
    stored_duplicates: int = 0
    stored_missing: int = 0
    wrong_tokens: int = 0
    max_stall_s: float = 0.0
    max_post_s: float = 0.0
    max_first_token_s: float = 0.0
    worst: str = ""  # where the longest stall happened
    worst_first: str = ""
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.scenario}: {self.requests} requests, lost requests {self.lost_requests}, "
                f"lost/duplicated batches {self.lost_batches}/{self.duplicated_batches} "
                f"(stored: missing {self.stored_missing}, duplicates {self.stored_duplicates}), "
                f"wrong token streams {self.wrong_tokens}, longest stall {self.max_stall_s:.2f} s, "
                f"slowest submit {self.max_post_s:.2f} s, slowest first token {self.max_first_token_s:.2f} s"
                f" [longest stall: {self.worst}; slowest first token: {self.worst_first}]")

    @property
    def clean(self) -> bool:
        return not (self.lost_requests or self.lost_batches or self.duplicated_batches or self.wrong_tokens
                    or self.stored_missing or self.stored_duplicates)


def verify(scenario: str, outcomes: list[Outcome], reference: list[list[int]],
           stored: dict[str, int] | None = None) -> Report:
    """Check every stream as its client saw it; measure what the fault cost."""
    rep = Report(scenario, requests=len(outcomes))
    for o in outcomes:
        rep.max_post_s = max(rep.max_post_s, o.post_s)
        tokens = [d for _, e, _, d in o.events if e == "tokens"]
        if o.status != 201 or not o.events or o.events[-1][1] != "done":
            rep.lost_requests += 1
            last = o.events[-1][1:] if o.events else None
            rep.problems.append(f"{o.id or '-'} via relay {o.relay}: status {o.status}, error {o.error}, last {last}")
            continue
        for _, e, _, d in o.events:
            if e not in ("tokens", "done"):
                rep.problems.append(f"{o.id}: event {e} {d}")
        seqs = [d["seq"] for d in tokens]
        rep.duplicated_batches += len(seqs) - len(set(seqs))
        final_seq = int(o.events[-1][2] or -1)  # the done event's id is the final batch's seq
        rep.lost_batches += len(set(range(final_seq + 1)) - set(seqs))
        index = 0
        for d in tokens:
            if d["index"] != index:
                rep.problems.append(f"{o.id}: batch {d['seq']} at index {d['index']}, expected {index}")
            index = d["index"] + len(d["token_ids"])
        ids = [t for d in tokens for t in d["token_ids"]]
        if ids != reference[o.prompt] or o.events[-1][3]["usage"]["completion_tokens"] != len(reference[o.prompt]):
            rep.wrong_tokens += 1
            rep.problems.append(f"{o.id}: {len(ids)} tokens differ from the undisturbed run")
        times = [t for t, *_ in o.events]
        if times and times[0] - o.started - o.post_s > rep.max_first_token_s:
            rep.max_first_token_s = times[0] - o.started - o.post_s
            rep.worst_first = f"{o.id} via relay {o.relay}"
        for (a, e, i, _), (b, *_) in zip(o.events, o.events[1:], strict=False):
            if b - a > rep.max_stall_s:
                rep.max_stall_s = b - a
                at = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - a)))
                rep.worst = f"{o.id} via relay {o.relay} after batch {i} ({e}) at {at}"
        if stored is not None and o.id is not None:
            # The final batch counts too; batch seqs are 0..final_seq.
            have = stored.get(token_subject(RELAY_OWNER, o.id), 0)
            rep.stored_missing += max(0, final_seq + 1 - have)
            rep.stored_duplicates += max(0, have - final_seq - 1)
    return rep
