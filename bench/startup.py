"""How long ``tokenpipe up`` takes to serve, cold and warm, and what its generators hold in memory.

    python -m bench.startup [--model smollm2-135m] [--generators 2] [--rounds 1]

Each round starts ``tokenpipe up`` (its console script, as a user runs it) on a fresh, empty data dir
(cold: the tokenizer read from the GGUF, the native library found or built, the kernel table not yet
measured), waits until every generator is ready, then until each generator's kernel table is final (the
one measured in the background replacing the rules, or read from the cache), reads each generator's idle
RSS, stops it and starts it again on the same data dir (warm). Times count from the command's start;
``after_nats_s`` from the moment its log says nats-server is ready (issue 49's goals: ready ≤ 30 s after
nats on a fresh data dir, ≤ 5 s warm). ``start_peak_mb`` is the largest generator RSS sampled (every
50 ms) while starting; the peak under load is ``python -m bench.kvcache --only up-memory``'s.

llama.cpp's server on the same GGUF (its time to answer ``/v1/models`` and its RSS) runs beside it where
``bench.peers`` finds llama-cpp-python's server (``--llama-python``); elsewhere it is reported as not
measured, with how to install it. Writes ``bench/out/startup.json``.

``--variant NAME:KEY=VALUE[,KEY=VALUE]`` (twice or more) compares environments on the warm start: each
round's warm starts go through the variants in turn on the same data dir (``--warm-starts`` each), and
the table adds each variant's median after nats and its ratio to the first variant's (``--restarts N``:
and how soon generator-0 is ready again after each of N ``kill -9``), e.g.
``--variant fork:TOKENPIPE_FORK_GENERATORS=1 --variant spawn:TOKENPIPE_FORK_GENERATORS=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenpipe_cli.upprocess import UpProcess

from .common import cpu_summary, rss_kib, write_json

__all__ = ["main", "table_final"]

console = Console(width=160)
_POLL_S = 0.05  # up.json and up.log are files another process writes: polled
_PENDING = "until the one measured"  # the start's table, before the measured one replaces it


def table_final(line: str) -> bool:
    """Whether a log line says a generator's kernel table is the one it keeps (measured, cached, rules for good)."""
    return ("kernel table (" in line and _PENDING not in line) or "table serves this run" in line


def _generator_pids(up: UpProcess) -> list[int]:
    return [int(r["pid"]) for r in up.status().get("roles", []) if r["name"].startswith("generator") and r.get("pid")]


def _rss_mb(pid: int) -> float:
    try:
        return rss_kib(pid) / 1024
    except OSError:  # gone (restarting)
        return 0.0


def _variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VALUE[,KEY=VALUE]`` as (name, environment)."""
    name, sep, pairs = spec.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
    if not name or not sep or not env:
        raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    return name, env


async def _one_start(data: Path, args: argparse.Namespace, *, wait_table: bool,
                     env: dict[str, str] | None = None, restarts: int = 0) -> dict[str, Any]:
    """One ``tokenpipe up`` on ``data``: its times to ready (and to final kernel tables), its generators' RSS."""
    exe = Path(sys.executable).with_name("tokenpipe")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "tokenpipe_cli"]
    extra = ["--quant", args.quant] if args.quant else []
    log = data / "up.log"
    offset = log.stat().st_size if log.exists() else 0  # up.log is appended to: this start's lines follow
    t0 = time.monotonic()
    up = UpProcess(data, "--model", args.model, "--generators", str(args.generators), *extra, command=command,
                   env={**os.environ, **(env or {})})
    marks: dict[str, float] = {}
    peak = 0.0

    def output() -> str:
        with log.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")

    try:
        deadline = t0 + args.timeout
        while "ready" not in marks:
            if up.proc.poll() is not None:
                raise RuntimeError(f"tokenpipe up exited with {up.proc.returncode}:\n{up.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tokenpipe up not ready within {args.timeout:g} s; see {up.log}")
            now = time.monotonic() - t0
            if "nats" not in marks and log.exists() and "nats-server ready" in output():
                marks["nats"] = now
            st = up.status()
            gens = [r for r in st.get("roles", []) if r["name"].startswith("generator")]
            if "first" not in marks and any(r["state"] == "ready" for r in gens):
                marks["first"] = now
            if st.get("state") == "up" and gens and all(r["state"] == "ready" for r in st.get("roles", [])):
                marks["ready"] = now
            peak = max([peak, *(_rss_mb(p) for p in _generator_pids(up))])
            await asyncio.sleep(_POLL_S)
        tables = None
        if wait_table:
            # Polled slowly: the measurement counts this process's CPU use as another's
            while (finals := sum(table_final(line) for line in output().splitlines())) < args.generators:
                if time.monotonic() > t0 + args.table_timeout:
                    break
                peak = max([peak, *(_rss_mb(p) for p in _generator_pids(up))])
                await asyncio.sleep(10 * _POLL_S)
            tables = time.monotonic() - t0 if finals >= args.generators else None
        idle = {str(pid): max(_rss_mb(pid) for _ in range(5) if not threading.Event().wait(0.2))
                for pid in _generator_pids(up)}
        lines = [line.split("generator", 1)[-1].strip()[:140] for line in output().splitlines()
                 if "kernel table (" in line or "not trusted" in line]
        again = [await _restart(up, deadline) for _ in range(restarts)]
    finally:
        await up.stop()
    nats = marks.get("nats")
    return {"first_ready_s": marks.get("first"), "ready_s": marks["ready"], "nats_s": nats,
            "after_nats_s": marks["ready"] - nats if nats is not None else None, "table_final_s": tables,
            "idle_rss_mb": idle, "start_peak_mb": peak, "table_lines": lines, "restart_s": again}


async def _restart(up: UpProcess, deadline: float) -> float:
    """kill -9 of generator-0 until it is ready again (a new pid, ``up.json`` says ready): seconds."""
    def gen0() -> dict[str, Any]:
        return next(r for r in up.status().get("roles", []) if r["name"] == "generator-0")

    while (g := gen0())["state"] != "ready" or not g.get("pid"):  # the last restart's may still be settling
        if time.monotonic() > deadline:
            raise RuntimeError(f"generator-0 not ready; see {up.log}")
        await asyncio.sleep(_POLL_S)
    pid = int(g["pid"])
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while not ((g := gen0())["state"] == "ready" and g.get("pid") not in (None, pid)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"generator-0 not ready again after kill -9; see {up.log}")
        await asyncio.sleep(_POLL_S)
    return time.monotonic() - t0


def _llamacpp(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """llama.cpp's server on the same GGUF: seconds to answer ``/v1/models``, its RSS idle; or why not measured."""
    from generator.model.preparation import _GGUF_FILE, _gguf_dir

    from .peers import make_peers, running

    gguf = _gguf_dir() / _GGUF_FILE
    peers = make_peers(argparse.Namespace(servers="llamacpp", threads=0, llama_python=args.llama_python,
                                          max_tokens=16), str(out_dir), out_dir, gguf if gguf.exists() else None)
    peer = peers[0]
    if isinstance(peer, str):
        return {"measured": False, "why": peer}
    out_dir.mkdir(parents=True, exist_ok=True)  # its log goes there before the JSON does
    t0 = time.monotonic()
    with running(peer, out_dir / "startup-llamacpp.log", args.timeout) as proc:
        ready = time.monotonic() - t0
        rss = max(_rss_mb(proc.pid) for _ in range(5) if not threading.Event().wait(0.2))
    return {"measured": True, "ready_s": ready, "idle_rss_mb": rss, "build": peer.build}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.startup", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default="", help="tokenpipe up --quant (default: the model's own)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    ap.add_argument("--table-timeout", type=float, default=600.0,
                    help="seconds after the start to wait for the final kernel tables")
    ap.add_argument("--llama-python", default="", help="bench.peers' llama-cpp-python (default: its own default)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="warm starts alternated between these environments (the cold start runs with the first)")
    ap.add_argument("--warm-starts", type=int, default=1, help="warm starts per variant per round")
    ap.add_argument("--restarts", type=int, default=0,
                    help="per variant's warm start: kill -9 generator-0 this many times, timing each until it is "
                         "ready again (the supervisor's backoff, 0.5 s, included)")
    ap.add_argument("--out", default="bench/out/startup.json")
    args = ap.parse_args(argv)
    if len(args.variant) == 1:
        ap.error("--variant: give two or more to compare")
    if not args.llama_python:
        from .peers import LLAMA_PYTHON

        args.llama_python = str(LLAMA_PYTHON)
    cpu = cpu_summary()
    console.print(f"[bold]bench.startup[/] · {cpu['line']} · {args.model}, {args.generators} generator(s)")
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tokenpipe-startup-") as tmp:
            data = Path(tmp) / "data"
            data.mkdir()
            first = args.variant[0][1] if args.variant else None
            cold = asyncio.run(_one_start(data, args, wait_table=True, env=first))
            console.print(f"  round {i + 1} cold: ready {cold['ready_s']:.1f} s, table final {cold['table_final_s']}")
            warm = asyncio.run(_one_start(data, args, wait_table=False, env=first))
            console.print(f"  round {i + 1} warm: ready {warm['ready_s']:.1f} s")
            by_variant: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in args.variant}
            for _ in range(args.warm_starts if args.variant else 0):
                for name, env in args.variant:
                    start = asyncio.run(_one_start(data, args, wait_table=False, env=env, restarts=args.restarts))
                    by_variant[name].append(start)
                    again = "".join(f", ready again {r:.2f} s after kill -9" for r in start["restart_s"])
                    console.print(f"  round {i + 1} warm, {name}: {start['after_nats_s']:.2f} s after nats{again}")
            rounds.append({"cold": cold, "warm": warm, "variants": by_variant})
    peer = {"measured": False, "why": "--no-llamacpp"} if args.no_llamacpp else \
        _llamacpp(args, Path(args.out).resolve().parent)
    result = {"model": args.model, "generators": args.generators, "quant": args.quant or "default", "cpu": cpu,
              "rounds": rounds, "summary": _summary(rounds), "llamacpp": peer,
              "variants": _variants(rounds, [(name, env) for name, env in args.variant])}
    console.print(_table(result))
    if result["variants"]:
        console.print(_variant_table(result["variants"]))
    write_json(args.out, result)
    console.print(f"wrote {args.out}")
    return 0


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def median(kind: str, key: str) -> float | None:
        values = [r[kind][key] for r in rounds if r[kind][key] is not None]
        return statistics.median(values) if values else None

    def rss(kind: str) -> float | None:
        values = [mb for r in rounds for mb in r[kind]["idle_rss_mb"].values()]
        return max(values) if values else None

    return {kind: {"ready_s": median(kind, "ready_s"), "after_nats_s": median(kind, "after_nats_s"),
                   "first_ready_s": median(kind, "first_ready_s"), "table_final_s": median(kind, "table_final_s"),
                   "idle_rss_mb": rss(kind), "start_peak_mb": max(r[kind]["start_peak_mb"] for r in rounds)}
            for kind in ("cold", "warm")}


def _variants(rounds: list[dict[str, Any]], variants: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """Each variant's warm starts after nats (every one, and the median) and its ratio to the first's."""
    out: list[dict[str, Any]] = []
    for name, env in variants:
        values = [s["after_nats_s"] for r in rounds for s in r["variants"][name] if s["after_nats_s"] is not None]
        again = [x for r in rounds for s in r["variants"][name] for x in s["restart_s"]]
        out.append({"name": name, "env": env, "after_nats_s": values,
                    "median_s": statistics.median(values) if values else None,
                    "restart_s": again, "restart_median_s": statistics.median(again) if again else None})
    base = out[0]["median_s"] if out else None
    for v in out:
        v["ratio"] = v["median_s"] / base if v["median_s"] is not None and base else None
    return out


def _variant_table(variants: list[dict[str, Any]]) -> Table:
    t = Table(title="warm starts, alternated (after nats; ratio to the first variant's median)")
    for col in ("variant", "environment", "each", "median", "÷ first", "kill -9 → ready again (median)"):
        t.add_column(col)
    for v in variants:
        t.add_row(v["name"], " ".join(f"{k}={val}" for k, val in v["env"].items()),
                  " ".join(f"{x:.2f}" for x in v["after_nats_s"]),
                  "—" if v["median_s"] is None else f"{v['median_s']:.2f} s",
                  "—" if v["ratio"] is None else f"{v['ratio']:.2f}",
                  "—" if v["restart_median_s"] is None else f"{v['restart_median_s']:.2f} s")
    return t


def _table(result: dict[str, Any]) -> Table:
    def fmt(v: float | None, unit: str = "s") -> str:
        return "—" if v is None else (f"{v:.1f} s" if unit == "s" else f"{v:.0f} MB")

    t = Table(title=f"tokenpipe up: {result['model']}, {result['generators']} generator(s) (medians; RSS: the "
                    f"largest generator's)")
    for col in ("start", "first generator ready", "all ready", "after nats", "kernel tables final",
                "generator idle RSS", "generator RSS peak while starting"):
        t.add_column(col)
    for kind, s in result["summary"].items():
        t.add_row(kind, fmt(s["first_ready_s"]), fmt(s["ready_s"]), fmt(s["after_nats_s"]), fmt(s["table_final_s"]),
                  fmt(s["idle_rss_mb"], "MB"), fmt(s["start_peak_mb"], "MB"))
    peer = result["llamacpp"]
    if peer["measured"]:
        t.add_row("llama.cpp server", "", fmt(peer["ready_s"]), "", "", fmt(peer["idle_rss_mb"], "MB"), "")
    else:
        t.add_row("llama.cpp server", "not measured", "", "", "", "", "", end_section=True)
        console.print(f"llama.cpp not measured: {peer['why']}")
    return t


if __name__ == "__main__":
    sys.exit(main())
