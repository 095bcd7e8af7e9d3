"""The benchmark suite's one entry point.

    python -m bench list [GROUP ...] [-v]                  # the registered scenarios (-v: their commands)
    python -m bench run TARGET ... [--quick] [--out-dir D] [-- ARGS]

A target is a group (system, engine, peers, gpu) or one scenario's name (see :mod:`bench.suite`). Each
scenario runs as its own process, in turn; a line says when each starts and how it ended (also when the
output is not a terminal), its own output in between. At the end: a summary table, and the run's record
(commands, exit statuses, times, each scenario's JSON) in ``<out-dir>/suite-<targets>.json``. The
scenarios' JSON goes to the same folder: ``bench/out/`` for the full forms, ``bench/out/quick/`` for
the quick ones. ``-- ARGS`` go to a single scenario's module after its own arguments (they win where
both give an option), e.g. ``python -m bench run pipeline -- --streams 8``. Exit status: 0 if every
scenario succeeded (or was skipped as not installed), 1 otherwise; every scenario has its turn either
way. SIGTERM stops the running scenario and the suite.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench.common import OUT_DIR, cpu_summary, write_json
from bench.suite import GROUPS, SCENARIOS, Scenario, UnknownTarget, select

ROOT = Path(__file__).resolve().parents[1]

_GROUP_TEXT = {"system": "processes, NATS and HTTP: the pipeline, the relay, the cluster, faults",
               "engine": "the model in this process: kernels, decode steps, the KV cache",
               "peers": "tokenpipe against the servers users would run instead",
               "gpu": "CUDA only (bench/gpu.sh)"}


def _say(line: str) -> None:
    """A progress line, flushed at once: a log or a pipe sees it before the scenario's own output."""
    print(f"==> {line}", flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} m {int(seconds % 60):02d} s"


def command(s: Scenario, quick: bool, out: Path, extra: list[str]) -> list[str]:
    """The scenario's command line: its form's arguments, its JSON path, then ``extra``."""
    return [sys.executable, "-m", s.module, *s.args(quick), "--out", str(out), *extra]


def _out_of(cmd: list[str]) -> str:
    """The last ``--out`` of a command line (a caller's ``-- --out F`` wins over the suite's)."""
    return next(cmd[i + 1] for i in range(len(cmd) - 2, -1, -1) if cmd[i] == "--out")


def _call(cmd: list[str]) -> tuple[int, bool]:
    """Run ``cmd`` from the repository root with our stdout and stderr; SIGTERM is passed on to it.
    Returns its exit status and whether the suite was told to stop meanwhile."""
    proc = subprocess.Popen(cmd, cwd=ROOT)
    stopped = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopped
        stopped = True
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait(), stopped
    except KeyboardInterrupt:  # Ctrl-C reached the scenario too (one process group): let it end first
        proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(targets: list[str], quick: bool, out_dir: Path, extra: list[str]) -> int:
    scenarios = select(targets)
    if extra and len(scenarios) != 1:
        raise UnknownTarget(f"arguments after `--` go to one scenario; {' '.join(targets)} is {len(scenarios)}")
    record: dict[str, Any] = {"targets": targets, "quick": quick, "cpu": cpu_summary(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "scenarios": []}
    summary = out_dir / f"suite-{'+'.join(targets)}.json"
    t_suite = time.monotonic()
    _say(f"{len(scenarios)} scenario{'s' if len(scenarios) != 1 else ''} ({'quick' if quick else 'full'} form) "
         f"on {record['cpu']['line']}; JSON to {out_dir}")
    for i, s in enumerate(scenarios, 1):
        cmd = command(s, quick, out_dir / f"{s.name}.json", extra)
        out = Path(_out_of(cmd))
        _say(f"[{i}/{len(scenarios)}] {s.name} ({s.group}) started at {time.strftime('%H:%M:%S')}: "
             f"python {' '.join(cmd[1:])}")
        t0 = time.monotonic()
        rc, stopped = _call(cmd)
        seconds = time.monotonic() - t0
        status = "ok" if rc == 0 else "skipped" if s.optional and rc == 2 else "failed"
        wrote = rc == 0 and out.exists() and out.stat().st_mtime >= time.time() - seconds - 1
        _say(f"[{i}/{len(scenarios)}] {s.name} {status} after {_duration(seconds)} (exit {rc})"
             + (f"; wrote {out}" if wrote else ""))
        record["scenarios"].append({"name": s.name, "group": s.group, "command": cmd[1:], "exit": rc,
                                    "status": status, "seconds": round(seconds, 1),
                                    "json": str(out) if wrote else None})
        record["seconds"] = round(time.monotonic() - t_suite, 1)
        write_json(summary, record)  # after each scenario: a suite cut short keeps what it measured
        if stopped:
            _say("stopped (SIGTERM): the remaining scenarios were not run")
            break
    _table(record["scenarios"], record["seconds"])
    _say(f"record: {summary}")
    failed = [r["name"] for r in record["scenarios"] if r["status"] == "failed"]
    if len(record["scenarios"]) < len(scenarios):
        return 128 + signal.SIGTERM
    return 1 if failed else 0


def _table(rows: list[dict[str, Any]], total: float) -> None:
    cells = [("scenario", "group", "status", "time", "JSON")]
    cells += [(r["name"], r["group"], f"{r['status']} ({r['exit']})" if r["exit"] else r["status"],
               _duration(r["seconds"]), r["json"] or "-") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    print("\n" + "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]), flush=True)
    print(f"{len(rows)} scenarios in {_duration(total)}", flush=True)


def list_scenarios(groups: list[str], verbose: bool) -> None:
    for group in groups or GROUPS:
        print(f"{group}: {_GROUP_TEXT[group]}")
        for s in SCENARIOS:
            if s.group != group:
                continue
            print(f"  {s.name:<12} {s.description}")
            if verbose:
                for form in ("full", "quick"):
                    print(f"  {'':<12}   {form + ':':<6} python -m {' '.join((s.module, *s.args(form == 'quick')))}")


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="the registered scenarios")
    ls.add_argument("groups", nargs="*", metavar="GROUP", help=f"{', '.join(GROUPS)} (default: all)")
    ls.add_argument("-v", "--verbose", action="store_true", help="each scenario's full and quick command")
    rn = sub.add_parser("run", help="run groups or scenarios, in turn")
    rn.add_argument("targets", nargs="+", metavar="TARGET", help=f"a group ({', '.join(GROUPS)}) or a scenario")
    rn.add_argument("--quick", action="store_true", help="each scenario's quick form")
    rn.add_argument("--out-dir", type=Path, default=None,
                    help=f"where the JSON goes (default: {OUT_DIR.relative_to(ROOT)}/, quick: .../quick/)")
    args = parser.parse_args(args_in)
    if args.cmd == "list":
        if unknown := [g for g in args.groups if g not in GROUPS]:
            parser.error(f"not a group: {', '.join(unknown)} (the groups: {', '.join(GROUPS)})")
        list_scenarios(args.groups, args.verbose)
        return 0
    out_dir = (args.out_dir or (OUT_DIR / "quick" if args.quick else OUT_DIR)).resolve()
    try:
        return run(args.targets, args.quick, out_dir, extra)
    except UnknownTarget as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the scenarios' lines interleave with ours in order
    sys.exit(main())
