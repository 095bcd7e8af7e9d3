"""``bench.placement`` (issue 47's benchmark) runs end to end over ``tokenpipe up --generators 1`` and
``2`` on a tiny workload, and its figures hold together: each phase's counters are that phase's; with 2
generators, the one holding a conversation is killed and its next turn served by the other."""

from __future__ import annotations

import json
from pathlib import Path

from tokenpipe_cli.launch import free_port

from .conftest import run_bench


def test_placement_benchmark_counts_each_phase_on_every_generator(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "placement.json"
    proc = run_bench(["bench.placement", "--generators", "1,2", "--conversations", "2", "--turns", "2",
                      "--doc-words", "120", "--answer-tokens", "4", "--unrelated", "4", "--unrelated-tokens", "6",
                      "--dtype", "float32", "--data-dir", str(data_dir), "--out", str(out)],
                     timeout=180, env={"TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.3",  # the counters' rounds: sooner
                                       # Not up's default 9101+i: a stack another worker started meanwhile took
                                       # 9101 between up's check and the generator's bind, and the bench found
                                       # no /metrics to count (CI, 12-06).
                                       "TOKENPIPE_METRICS_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["generators"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        chats, balance = run["conversations"], run["balance"]
        assert chats["turns"] == 4 and chats["failed"] == 0
        per = chats["per_generator"]
        assert len(per) == run["generators"] and sum(p["requests"] for p in per) == 4
        # The prefix cache looks up every prompt token once: the phase's queries are its turns' prompts,
        # neither the warm-up's nor the unrelated streams' (each phase read after its counters moved).
        assert chats["queries"] == sum(p["queries"] for p in per) == sum(s["prompt_tokens"] for s in chats["samples"])
        assert 0 <= chats["hit_rate"] <= 1 and chats["hits"] == sum(p["hits"] for p in per)
        prompts = {(s["conv"], s["turn"]): s["prompt_tokens"] for s in chats["samples"]}
        assert all(prompts[c, 1] > prompts[c, 0] > 120 for c in (0, 1))  # the whole history is resent
        assert chats["ttft_ms"]["first_p50"] > 0 and chats["ttft_ms"]["later_p50"] > 0
        counts = balance["per_generator_requests"]
        assert len(counts) == run["generators"] and sum(counts) == 4 and balance["failed"] == 0
        assert 1 / run["generators"] <= balance["busiest_fraction"] <= 1
        assert balance["tokens"] == 4 * 6 and balance["tokens_per_s"] > 0
    one, two = result["runs"]
    # One generator holds every conversation's history: its later turns find the document cached.
    assert one["conversations"]["hit_rate"] > 0.3
    assert one["vs_one"]["hit_rate"] == 1 and two["vs_one"]["hit_rate"] is not None
    assert {g["goal"] for g in result["goals"]} >= {"G=2: fleet hit rate >= 0.95x G=1's",
                                                    "G=2: busiest generator runs <= 60 % of the unrelated streams"}
    # kill -9 of the generator holding a conversation: its next turn was served by the other one, and a
    # history of the same shape was measured cold beside it.
    assert one["takeover"] == [] and len(two["takeover"]) == 1
    kill = two["takeover"][0]
    assert kill["served_by"] == [1 - kill["holder"]], kill
    assert kill["after_kill_ms"] > 0 and kill["cold_ms"] > 0 and kill["warm_ms"] > 0
    assert abs(kill["cold_prompt_tokens"] - kill["prompt_tokens"]) <= 0.2 * kill["prompt_tokens"], kill
    assert any(g["goal"].startswith("G=2: after kill -9 of its generator") for g in result["goals"])
    assert "placement: 2 conversations x 2 turns" in proc.stdout
