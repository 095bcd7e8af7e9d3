"""Chaos: random kills and freezes under a steady load, every stream checked against its stored replay.

    python -m bench.chaos [--duration 1800] [--faults 200] [--rate 1] [--max-stop 40]
                           [--only generator,relay,nats|'generator kill -9'] [--out bench/out/chaos.json] [--log FILE]

Starts ``tokenpipe up --nats-cluster 3 --generators 2 --model tiny-random`` plus a second relay
(a ``tokenpipe relay`` on the same cluster), submits sampled streams (temperature 0.9, no seed:
two writers of one stream would write different tokens) at ``--rate`` per second, each read live
over SSE from one of the two relays (a dropped or silent connection resumes with
``Last-Event-ID`` on the other), and meanwhile, one at a time on a whole stack, injects a random
fault: ``kill -9`` or SIGSTOP (2 s to ``--max-stop`` s) of a generator, a relay or a NATS node
(leaders included: the node is drawn at random). ``tokenpipe up`` restarts what was killed; the
second relay is restarted here.

Every request must end ``done`` or ``error``, and what its client saw live must be exactly a
replay of the stored stream (read from the start afterwards): token for token, contiguous,
nothing twice. A stream that does not is a *violation*, reported with its id and the batch
where it diverged. Stalls are the gaps between a stream's token events during which a fault
was injected, per fault kind: p50 / p99 / max, and the same over gaps that fault alone fell in
(what one kind costs without the others overlapping it). The JSON goes to ``--out``; a table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_json
from producer import aiter_sse
from tokenpipe_cli.launch import LaunchError, die_with_parent, free_port
from tokenpipe_cli.upprocess import UpProcess

__all__ = ["main", "run"]

KINDS = [f"{role} {how}" for role in ("generator", "relay", "nats") for how in ("kill -9", "SIGSTOP")]
READ_TIMEOUT_S = 8.0  # a silent connection (its relay frozen) is resumed on the other relay after this


@dataclass
class Fault:
    kind: str
    target: str
    pid: int
    at: float
    until: float  # the thaw (SIGSTOP) or the kill itself


@dataclass
class StreamRun:
    sid: str = ""
    started: float = 0.0
    end: str = ""  # done, error, or "" (never ended: a violation)
    error: str = ""
    live: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    resumes: int = 0
    violation: str = ""


def _body() -> dict[str, Any]:
    return {"prompt": f"chaos {random.randrange(10**6)}", "max_tokens": random.randint(40, 160),
            "temperature": 0.9, "ignore_eos": True}


async def _post(urls: list[str], body: dict[str, Any], deadline: float) -> str:
    i = random.randrange(len(urls))
    async with httpx.AsyncClient(timeout=20) as http:
        while True:
            try:
                r = await http.post(f"{urls[i % len(urls)]}/v1/streams", json=body)
                if r.status_code == 201:
                    return str(r.json()["id"])
            except httpx.HTTPError:
                pass  # that relay is down or frozen: the other one
            if time.monotonic() > deadline:
                raise TimeoutError("no relay accepted the request")
            i += 1
            await asyncio.sleep(0.5)


async def _read(urls: list[str], run: StreamRun, deadline: float) -> None:
    """Live, resuming on the other relay after a drop or READ_TIMEOUT_S of silence."""
    last_id: str | None = None
    i = random.randrange(len(urls))
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout) as http:
        while time.monotonic() < deadline:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with http.stream("GET", f"{urls[i % len(urls)]}/v1/streams/{run.sid}", headers=headers) as r:
                    if r.status_code != 200:
                        raise httpx.HTTPError(f"status {r.status_code}")
                    async for ev in aiter_sse(r):
                        if ev.event == "tokens":
                            run.live.append(ev.json())
                            run.arrivals.append(time.monotonic())
                            last_id = ev.id or last_id
                        elif ev.event in ("done", "error"):
                            run.end = ev.event
                            run.error = ev.data if ev.event == "error" else ""
                            return
            except httpx.HTTPError:
                pass
            run.resumes += 1
            i += 1
            await asyncio.sleep(0.2)


async def _replay(urls: list[str], sid: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as http:
        for attempt in range(20):
            url = urls[attempt % len(urls)]
            try:
                out: list[dict[str, Any]] = []
                async with http.stream("GET", f"{url}/v1/streams/{sid}") as r:
                    async for ev in aiter_sse(r):
                        if ev.event == "tokens":
                            out.append(ev.json())
                        elif ev.event in ("done", "error"):
                            return out
            except httpx.HTTPError:
                await asyncio.sleep(1.0)
    raise TimeoutError(f"stream {sid} could not be replayed")


def check(run: StreamRun, replay: list[dict[str, Any]]) -> str:
    """'' when the live read is contiguous, each batch once, and exactly the replay; else where it diverged."""
    index = 0
    for n, d in enumerate(run.live):
        if d["seq"] != n or d["index"] != index:
            return f"live batch {n}: seq {d['seq']} index {d['index']}, expected seq {n} index {index}"
        index += len(d["token_ids"])
    for n, (a, b) in enumerate(zip(run.live, replay, strict=False)):
        if a["token_ids"] != b["token_ids"]:
            return f"batch {n} (token index {a['index']}) differs from the stored replay"
    if len(run.live) != len(replay):
        return f"live saw {len(run.live)} batches, the store holds {len(replay)}"
    return ""


class Chaos:
    def __init__(self, data: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.data = data
        self.up = UpProcess(data, "--model", "tiny-random", "--nats-cluster", "3", "--generators", "2",
                            env={**os.environ, "TOKENPIPE_THREADS": "1", "TOKENPIPE_DTYPE": "float32",
                                 "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.5", "TOKENPIPE_SUBMIT_RETRY_S": "60",
                                 # the kills are this run's own, not a crash loop for up to give up on
                                 "TOKENPIPE_RESTART_LIMIT": "1000000"})
        self.relay2_port = free_port()
        self.relay2: subprocess.Popen[bytes] | None = None
        self.faults: list[Fault] = []
        self.runs: list[StreamRun] = []
        self.killed: set[int] = set()  # pids killed: the stack is whole once none of them is listed
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        self.kinds = [k for k in KINDS if not only or k in only or k.split(" ", 1)[0] in only]
        if not self.kinds:
            raise SystemExit(f"--only {args.only!r} names no role (generator, relay, nats) and no fault of: "
                             f"{', '.join(KINDS)}")

    @property
    def urls(self) -> list[str]:
        return [self.up.url, f"http://127.0.0.1:{self.relay2_port}"]

    def start_relay2(self) -> None:
        st = self.up.status()
        log = open(self.data / "relay2.log", "ab")  # noqa: SIM115 - the child keeps it
        self.relay2 = subprocess.Popen(
            [sys.executable, "-m", "tokenpipe_cli", "relay", "--nats-url", st["nats_url"], "--data-dir",
             str(self.data), "--nats-creds", str(self.data / "creds" / "relay.json"), "--port",
             str(self.relay2_port), "--model", "tiny-random"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    async def whole(self, timeout: float = 120.0) -> None:
        """Until every role of the stack and the second relay are up and answering."""
        deadline = time.monotonic() + timeout
        # up.json lists a killed role as ready until the supervisor notices: wait for its new pid.
        while {r.get("pid") for r in self.up.status().get("roles", [])} & self.killed:
            if time.monotonic() > deadline:
                raise TimeoutError("a killed role was not restarted")
            await asyncio.sleep(0.2)
        await self.up.wait_up(timeout)
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.relay2 is None or self.relay2.poll() is not None:
                    self.start_relay2()
                try:
                    if (await http.get(f"{self.urls[1]}/readyz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError("the second relay did not come up")

    def _targets(self, role: str) -> list[tuple[str, int]]:
        out = [(r["name"], r["pid"]) for r in self.up.status().get("roles", [])
               if r["name"].startswith({"generator": "generator", "relay": "relay", "nats": "nats-server"}[role])
               and r.get("pid")]
        if role == "relay" and self.relay2 is not None and self.relay2.poll() is None:
            out.append(("relay-2", self.relay2.pid))
        return out

    async def inject(self) -> None:
        kind = random.choice(self.kinds)
        role, how = kind.split(" ", 1)
        name, pid = random.choice(self._targets(role))
        now = time.monotonic()
        if how == "kill -9":
            os.kill(pid, signal.SIGKILL)
            self.killed.add(pid)
            self.faults.append(Fault(kind, name, pid, now, now))
            return
        stop = random.uniform(2.0, self.args.max_stop)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(stop)  # the freeze's length is the fault
        finally:
            os.kill(pid, signal.SIGCONT)
        self.faults.append(Fault(kind, name, pid, now, time.monotonic()))

    async def one_stream(self) -> None:
        run = StreamRun(started=time.monotonic())
        self.runs.append(run)
        deadline = run.started + self.args.stream_deadline
        try:
            run.sid = await _post(self.urls, _body(), deadline)
            await _read(self.urls, run, deadline)
        except TimeoutError as exc:
            run.error = str(exc)

    async def load(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks: list[asyncio.Task[None]] = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(self.one_stream()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=random.expovariate(self.args.rate))
        return tasks

    async def run(self) -> dict[str, Any]:
        await self.whole(300)
        stop = asyncio.Event()
        loader = asyncio.create_task(self.load(stop))
        t_end = time.monotonic() + self.args.duration
        await asyncio.sleep(3)  # the load first, so the first fault meets streams in flight
        while time.monotonic() < t_end and len(self.faults) < self.args.faults:
            await asyncio.sleep(random.uniform(1.0, 4.0))
            try:
                await self.whole()  # one fault at a time: the last one's role is back first
            except TimeoutError as exc:
                print(f"stack not whole: {exc}")
            await self.inject()
            print(f"fault {len(self.faults)}: {self.faults[-1].kind} of {self.faults[-1].target}", flush=True)
        stop.set()
        tasks = await loader
        await self.unless_up_exits(asyncio.gather(*tasks))
        await self.whole()
        gate = asyncio.Semaphore(16)

        async def verify(run: StreamRun) -> None:
            if run.sid and run.end:
                async with gate:
                    run.violation = check(run, await _replay(self.urls, run.sid))
            elif not run.end:
                run.violation = f"never ended ({run.error or 'no done/error event'})"

        await asyncio.gather(*(verify(r) for r in self.runs))
        return self.report()

    async def unless_up_exits(self, work: asyncio.Future[Any]) -> None:
        """``work``, failing at once (with up's last lines) if ``tokenpipe up`` exits meanwhile: its
        streams would otherwise only end at their deadline."""
        while not work.done():
            if self.up.proc.poll() is not None:
                work.cancel()
                raise LaunchError(f"tokenpipe up exited with {self.up.proc.returncode}:\n{self.up.output()[-4000:]}")
            await asyncio.wait([work], timeout=1.0)
        work.result()

    def _gaps(self, run: StreamRun) -> list[tuple[float, float, list[Fault]]]:
        """A stream's gaps between token events (from its POST), each with the faults that fell in it."""
        return [(a, b, [f for f in self.faults if a <= f.until and b >= f.at])
                for a, b in itertools.pairwise([run.started, *run.arrivals])]

    def stalls(self) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Per fault kind, each affected stream's longest gap between token events that a fault fell
        in; and the same counting only gaps that no other fault fell in (what that kind costs alone:
        in the first, a NATS node's 40 s freeze also lands under a generator kill that it overlapped)."""
        every: dict[str, list[float]] = {k: [] for k in KINDS}
        alone: dict[str, list[float]] = {k: [] for k in KINDS}
        for run in self.runs:
            spans = [(b - a, fs) for a, b, fs in self._gaps(run)]
            for f in self.faults:
                hit = [g for g, fs in spans if f in fs]
                if hit:
                    every[f.kind].append(max(hit))
                only = [g for g, fs in spans if fs == [f]]
                if only:
                    alone[f.kind].append(max(only))
        return every, alone

    def longest_stalls(self, n: int = 5) -> list[dict[str, Any]]:
        """The ``n`` longest gaps of any stream, each with the faults it spanned (a gap is counted in
        :meth:`stalls` under every one of them, so this says which fault kept a stream waiting)."""
        t0 = min((f.at for f in self.faults), default=0.0)
        number = {id(f): i + 1 for i, f in enumerate(self.faults)}
        gaps = [(b - a, run.sid, a, b, fs) for run in self.runs for a, b, fs in self._gaps(run)]
        return [{"stall_s": round(g, 2), "stream": sid, "from_s": round(a - t0, 1), "to_s": round(b - t0, 1),
                 "faults": [f"{number[id(f)]}: {f.kind} of {f.target} at {f.at - t0:.1f} s for {f.until - f.at:.1f} s"
                            for f in fs]}
                for g, sid, a, b, fs in sorted(gaps, key=lambda x: x[0], reverse=True)[:n]]

    def report(self) -> dict[str, Any]:
        def summary(xs: list[float]) -> dict[str, float | int | None]:
            p99 = sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None
            return {"n": len(xs), "p50": statistics.median(xs) if xs else None, "p99": p99,
                    "max": max(xs) if xs else None}

        stalls, alone = self.stalls()
        return {
            "faults": len(self.faults),
            "by_kind": {k: sum(f.kind == k for f in self.faults) for k in KINDS},
            "requests": len(self.runs),
            "done": sum(r.end == "done" for r in self.runs),
            "error": sum(r.end == "error" for r in self.runs),
            "violations": [{"stream": r.sid, "where": r.violation} for r in self.runs if r.violation],
            "stalls_s": {k: summary(v) for k, v in stalls.items()},
            "stalls_alone_s": {k: summary(v) for k, v in alone.items()},
            "longest_stalls": self.longest_stalls(),
            "fault_log": [asdict(f) for f in self.faults],
            "errors": sorted({r.error[:200] for r in self.runs if r.end == "error"}),
        }

    async def close(self) -> None:
        if self.relay2 is not None and self.relay2.poll() is None:
            self.relay2.terminate()
        await self.up.stop()
        if self.args.log:
            Path(self.args.log).write_text(self.up.output())


async def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokenpipe-chaos-") as tmp:
        data = Path(tmp)
        (data_dir / "models").mkdir(parents=True, exist_ok=True)  # a fresh machine: converted here, kept there
        (data / "models").symlink_to((data_dir / "models").resolve(), target_is_directory=True)
        chaos = Chaos(data, args)
        try:
            return await chaos.run()
        finally:
            await chaos.close()


def table(rep: dict[str, Any]) -> str:
    lines = [f"faults {rep['faults']}, requests {rep['requests']} (done {rep['done']}, error {rep['error']}), "
             f"violations {len(rep['violations'])}", "",
             "| fault | injected | streams stalled | stall p50 s | p99 s | max s | alone: p99 s | max s |",
             "|---|---|---|---|---|---|---|---|"]

    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    for k, s in rep["stalls_s"].items():
        a = rep["stalls_alone_s"][k]
        lines.append(f"| {k} | {rep['by_kind'][k]} | {s['n']} | {f(s['p50'])} | {f(s['p99'])} | {f(s['max'])} "
                     f"| {f(a['p99'])} | {f(a['max'])} |")
    lines += ["", "longest stalls (seconds from the first fault; the faults each one spanned):"]
    lines += [f"{s['stall_s']:.2f} s, stream {s['stream']}, {s['from_s']}-{s['to_s']} s: "
              f"{'; '.join(s['faults']) or 'no fault'}" for s in rep.get("longest_stalls", [])]
    lines += [f"violation: {v['stream']}: {v['where']}" for v in rep["violations"]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from tokenpipe.settings import Settings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of faults at most")
    p.add_argument("--faults", type=int, default=200, help="stop after this many faults")
    p.add_argument("--rate", type=float, default=1.0, help="new streams per second")
    p.add_argument("--max-stop", type=float, default=40.0, help="longest SIGSTOP, seconds (the shortest is 2)")
    p.add_argument("--only", default="", help="inject only these faults (comma-separated roles: generator, relay, "
                   "nats; or faults: 'generator kill -9' for takeovers alone); default every fault of all three")
    p.add_argument("--stream-deadline", type=float, default=300.0,
                   help="a stream not ended this long after its POST is reported as a violation (never ended)")
    p.add_argument("--seed", type=int, default=None, help="the fault schedule's random seed")
    p.add_argument("--data-dir", default=Settings.load().data_dir, help="where the converted models are cached")
    p.add_argument("--out", default="bench/out/chaos.json")
    p.add_argument("--log", default="", help="keep the stack's log (every role's lines) in this file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    random.seed(args.seed)
    rep = asyncio.run(run(args, Path(args.data_dir)))
    rep["args"] = {k: v for k, v in vars(args).items()}
    rep["cpu"] = platform.processor() or platform.machine()
    print(table(rep))
    out = Path(args.out)
    write_json(out, rep, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
