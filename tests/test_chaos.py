"""The chaos run's short form (bench.chaos): `tokenpipe up --nats-cluster 3 --generators 2` and a
second relay under a steady sampled load while generators, relays and NATS nodes are killed and
frozen at random. Every request ends `done` or `error`, and every client saw live exactly what
the store holds (the single-writer rule: tokenpipe.append). The long form is `make bench`."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import parser, run, table

pytestmark = pytest.mark.timeout(540)


def _lines_about(log: Path, streams: list[str], most: int = 60) -> str:
    """The stack's log lines that name one of ``streams``: what a failure report needs."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join([line for line in text.splitlines() if any(s and s in line for s in streams)][-most:])


async def test_chaos_short_form_no_violations(data_dir: Path, tmp_path: Path) -> None:
    args = parser().parse_args(["--duration", "100", "--faults", "12", "--rate", "0.7", "--max-stop", "8",
                              # a stream that never ends is reported (with its id) well before the test's timeout
                              "--stream-deadline", "150", "--log", str(tmp_path / "stack.log")])
    rep = await run(args, data_dir)
    print(table(rep))
    assert rep["faults"] >= 6, rep["fault_log"]
    assert rep["requests"] >= 20
    assert rep["violations"] == [], table(rep) + "\n" + _lines_about(tmp_path / "stack.log",
                                                                     [v["stream"] for v in rep["violations"]])
    assert rep["done"] + rep["error"] == rep["requests"]
    assert rep["done"] >= rep["requests"] // 2, rep["errors"]
    # The longest gaps, each with the faults it spanned: no per-kind maximum exceeds the first.
    longest = [s["stall_s"] for s in rep["longest_stalls"]]
    assert longest and longest == sorted(longest, reverse=True)
    assert max(s["max"] or 0.0 for s in rep["stalls_s"].values()) <= longest[0] + 0.01
