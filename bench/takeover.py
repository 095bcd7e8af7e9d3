"""Takeover time: ``kill -9`` of the generator holding a stream -> the client's next token.

    python -m bench.takeover [--kills 10] [--model tiny-random] [--out bench/out/takeover.json]

Runs ``tokenpipe up --generators 2`` as a user does (a subprocess, default settings, a temporary
data dir), and for each kill: starts a greedy stream, kills its generator with SIGKILL once the
client has seen some tokens, and times the gap until the next token reaches the client. Each
stream is read on after the takeover and checked against an undisturbed run: contiguous
indices, no duplicate, the same greedy tokens. The supervisor restarts the killed generator;
the next round waits until ``up.json`` says both are ready again.

``--ack-cost`` also measures what the in-progress acks cost at 32 held requests (CPU per
progress tick, in the worker and in nats-server).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from producer import aiter_sse
from tokenpipe.settings import Settings
from tokenpipe_cli.upprocess import UpProcess

from .common import cpu_seconds, write_json

BODY = {"prompt": "keep going", "temperature": 0, "ignore_eos": True}  # default coalescing, as a user gets


def start_up(data: Path, model: str, generators: int) -> UpProcess:
    # Ten kills in a couple of minutes are a crash loop by the default limit (5 in 60 s): these
    # are on purpose. Nothing else differs from the defaults (ack_wait, progress interval).
    # Announcements every 0.5 s find the holder sooner, so the kill lands early in the stream; they
    # play no part in the takeover itself (ack_wait and the progress acks do).
    env = {**os.environ, "TOKENPIPE_LOG_LEVEL": "WARNING", "TOKENPIPE_RESTART_LIMIT": "1000",
           "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.5"}
    return UpProcess(data, "--model", model, "--generators", str(generators), env=env)


async def _read(http: httpx.AsyncClient, sid: str, until: int, on_tokens: Any = None) -> list[tuple[float, dict]]:
    """(arrival time, tokens event) until ``until`` tokens arrived (or the stream ended)."""
    got: list[tuple[float, dict]] = []
    n = 0
    async with http.stream("GET", f"/v1/streams/{sid}") as resp:
        async for ev in aiter_sse(resp):
            if ev.event == "tokens":
                data = ev.json()
                got.append((time.monotonic(), data))
                n += len(data["token_ids"])
                if on_tokens is not None:
                    await on_tokens(n)
                if n >= until:
                    break
            elif ev.event in ("done", "error"):
                break
    return got


async def one_kill(up: UpProcess, http: httpx.AsyncClient, reference: list[int], max_tokens: int,
                   kill_at: int) -> dict[str, Any]:
    sid = (await http.post("/v1/streams", json={**BODY, "max_tokens": max_tokens})).json()["id"]
    killed: list[tuple[int, float]] = []

    async def on_tokens(n: int) -> None:
        if n >= kill_at and not killed:
            pid = await up.holder(sid)
            os.kill(pid, signal.SIGKILL)
            killed.append((pid, time.monotonic()))

    # To the end: the killed generator may have published well ahead of what the client had read
    # when it was found and killed, so the pause can come late in the stream.
    got = await _read(http, sid, max_tokens, on_tokens)
    if not killed:
        raise RuntimeError("the stream ended before its generator was killed")
    t_kill = killed[0][1]
    before = [t for t, _ in got if t <= t_kill]
    # Tokens published before the kill can still arrive after it: the takeover is where the longest
    # pause after the kill ends (the first token the new generator produced).
    window = [before[-1], *(t for t, _ in got if t > t_kill)] if before else []
    pause, resumed = max(((b - a, b) for a, b in itertools.pairwise(window)), default=(None, None))
    ids: list[int] = []
    contiguous = True
    for seq, (_, d) in enumerate(got):
        contiguous &= d["seq"] == seq and d["index"] == len(ids)
        ids.extend(d["token_ids"])
    gaps = [b - a for a, b in itertools.pairwise(before)]
    return {"stream": sid, "killed_pid": killed[0][0], "takeover_s": resumed - t_kill if resumed else None,
            "pause_s": pause,
            "normal_gap_ms": 1000 * statistics.median(gaps) if gaps else None, "tokens": len(ids),
            "contiguous": contiguous, "same_as_undisturbed": ids == reference}


async def takeover(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokenpipe-takeover-") as tmp:
        data = Path(tmp)
        models = Path(args.data_dir) / "models"
        if models.is_dir():
            (data / "models").symlink_to(models.resolve(), target_is_directory=True)  # no conversion per run
        up = start_up(data, args.model, 2)
        try:
            await up.wait_up()
            async with httpx.AsyncClient(base_url=up.url, timeout=120) as http:
                sid = (await http.post("/v1/streams", json={**BODY, "max_tokens": args.max_tokens})).json()["id"]
                reference = [t for _, d in await _read(http, sid, args.max_tokens) for t in d["token_ids"]]
                rounds = []
                with Progress(console=console) as progress:
                    task = progress.add_task("kill -9 the holder", total=args.kills)
                    for _ in range(args.kills):
                        await up.wait_up()
                        rounds.append(await one_kill(up, http, reference, args.max_tokens, args.kill_at))
                        progress.advance(task)
        finally:
            await up.stop()
            out = Path(args.out).with_suffix(".log")  # the stack's output (warnings and restarts), for a look
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(up.log.read_bytes())
    times = [r["takeover_s"] for r in rounds if r["takeover_s"] is not None]
    pauses = [r["pause_s"] for r in rounds if r["pause_s"] is not None]
    settings = Settings.load(env={})
    return {"kills": len(rounds), "model": args.model, "ack_wait_s": settings.ack_wait_s,
            "progress_interval_s": settings.progress_interval_s,
            "takeover_p50_s": statistics.median(times), "takeover_max_s": max(times),
            "pause_p50_s": statistics.median(pauses), "pause_max_s": max(pauses),
            "all_contiguous": all(r["contiguous"] for r in rounds),
            "all_same_as_undisturbed": all(r["same_as_undisturbed"] for r in rounds), "rounds": rounds}


async def ack_cost(rounds: int = 300, streams: int = 32) -> dict[str, Any]:
    """What the in-progress acks cost at ``streams`` held requests: a real nats-server and the
    generator's own consumer; ``rounds`` times one in-progress ack per held request (what one
    progress tick sends), CPU measured in this process (the worker's side) and in nats-server.
    A throughput A/B of whole pipelines was tried first and drowned in this shared machine's
    noise (the same setting run twice differed by 15-25 %)."""
    from generator.service.intake import RequestIntake
    from tokenpipe.bus import connect
    from tokenpipe.subjects import REQUESTS_STREAM, consumer_name, request_subject
    from tokenpipe_cli.natsserver import NatsServer

    with tempfile.TemporaryDirectory(prefix="tokenpipe-ackcost-") as tmp, NatsServer(Path(tmp)) as server:
        settings = Settings.load(env={}, nats_url=server.url)
        bus = await connect(settings, name="bench-ack-cost")
        try:
            intake = RequestIntake(bus, "ack-cost", settings)
            await intake.subscribe()
            for i in range(streams):
                await bus.js.publish(request_subject("ack-cost", bus.owner), b"x",
                                     headers={"Nats-Msg-Id": f"ack-cost-{i}"})
            held: list[Any] = []
            while len(held) < streams:
                held += await intake.pull.fetch(streams - len(held), timeout=5)
            assert server.pid is not None
            cpu0, srv0, wall0 = time.process_time(), cpu_seconds(server.pid), time.perf_counter()
            for _ in range(rounds):
                for msg in held:
                    await msg.in_progress()
                await bus.nc.flush()
            cpu, srv = time.process_time() - cpu0, cpu_seconds(server.pid) - srv0
            wall = time.perf_counter() - wall0
            for msg in held:
                await msg.ack()
            await intake.close()
            await bus.js.delete_consumer(REQUESTS_STREAM, consumer_name("ack-cost"))
        finally:
            await bus.close()
    per_tick_ms = 1000 * cpu / rounds
    return {"streams": streams, "ticks": rounds, "worker_cpu_ms_per_tick": per_tick_ms,
            "nats_server_cpu_ms_per_tick": 1000 * srv / rounds, "wall_ms_per_tick": 1000 * wall / rounds,
            # One tick per second (the default interval) vs one per 30 s, as a share of one core:
            "worker_core_share_every_1s": per_tick_ms / 1000, "worker_core_share_every_30s": per_tick_ms / 30000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--kill-at", type=int, default=30, help="kill once the client has seen this many tokens")
    parser.add_argument("--ack-cost", action="store_true", help="also measure what the progress acks cost")
    parser.add_argument("--data-dir", default=Settings.load().data_dir, help="where the converted models are cached")
    parser.add_argument("--out", default="bench/out/takeover.json")
    args = parser.parse_args(argv)
    console = Console(width=120)
    result: dict[str, Any] = {"takeover": asyncio.run(takeover(args, console))}
    t = result["takeover"]
    table = Table(title=f"kill -9 of the generator holding a stream ({t['kills']} kills, {args.model}, "
                        f"ack_wait {t['ack_wait_s']:g} s, progress every {t['progress_interval_s']:g} s)")
    for col in ("kill -> next token: p50", "max", "longest pause seen: p50", "max", "contiguous, no duplicate",
                "same greedy tokens"):
        table.add_column(col)
    table.add_row(f"{t['takeover_p50_s']:.2f} s", f"{t['takeover_max_s']:.2f} s", f"{t['pause_p50_s']:.2f} s",
                  f"{t['pause_max_s']:.2f} s", str(t["all_contiguous"]), str(t["all_same_as_undisturbed"]))
    console.print(table)
    if args.ack_cost:
        result["ack_cost"] = c = asyncio.run(ack_cost())
        console.print(f"in-progress acks for 32 held requests: {c['worker_cpu_ms_per_tick']:.2f} ms worker CPU and "
                      f"{c['nats_server_cpu_ms_per_tick']:.2f} ms nats-server CPU per tick; every 1 s that is "
                      f"{100 * c['worker_core_share_every_1s']:.3f} % of a core "
                      f"(every 30 s: {100 * c['worker_core_share_every_30s']:.4f} %)")
    write_json(args.out, result, indent=1)
    console.print(f"written to {args.out}")
    ok = t["all_contiguous"] and t["all_same_as_undisturbed"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
