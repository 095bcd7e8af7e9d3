"""``bench.transports`` (WebSocket vs SSE per stream) runs end to end on a small load."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import run_bench


def test_transports_benchmark_delivers_every_batch_over_both_transports(tmp_path: Path) -> None:
    out = tmp_path / "transports.json"
    proc = run_bench(["bench.transports", "--streams", "20", "--sockets", "4", "--batches", "5", "--rate", "200",
                      "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["transport"], r["connections"]) for r in runs] == [("sse", 20), ("websocket", 4)]
    for r in runs:
        assert r["batches_delivered"] == r["batches_expected"] == 100
        assert r["rss_per_stream_kib"] != 0 or r["relay_rss_open_kib"] > 0
        steady = r["steady_latency_ms"]
        assert 0 < steady["p50"] <= steady["p99"]
    assert set(result["websocket_over_sse"]) <= {"relay_cpu_us_per_batch", "rss_per_stream_kib"}
    assert "WebSocket ÷ SSE" in proc.stdout
