"""The pipeline benchmark's figures, from the records of its HTTP phases and the engine's own.

Every comparison is a ratio within one run: the pipeline's tok/s against the engine
in-process and the raw forward ceiling; its TTFT minus the engine's own prefill.
"""

from __future__ import annotations

import statistics
from typing import Any

from tokenpipe_cli.loadgen import Record

from .common import pct
from .drive import Round, Runs

__all__ = ["added_ms", "goals", "pipeline_figures", "ratios", "stage_breakdown", "ttft_figures"]

# Where the first batch's time goes: (from, to) timestamps, the batch's own stamps plus the
# client's wall clock at the POST ("start") and at the first event ("arrival"), same host clock.
STAGES = {"client → relay (POST → request built)": ("start", "created"),
          "relay → generator (built → received)": ("created", "received"),
          "generator → engine (received → admitted)": ("received", "admitted"),
          "prefill (admitted → first token)": ("admitted", "first_token"),
          "coalescer (first token → emitted)": ("first_token", "emitted"),
          "generator → client (emitted → first SSE event)": ("emitted", "arrival")}


def added_ms(recs: list[Record]) -> list[float]:
    """Per request: client TTFT minus the engine's own part (prefill: admitted -> first token)."""
    return [s.ttft * 1e3 - (s.first_timings["first_token"] - s.first_timings["admitted"]) / 1e6
            for s in recs if "admitted" in s.first_timings]


def _tok_s(rounds: list[Round]) -> list[float]:
    return [sum(r.tokens for r in batch) / wall for batch, wall in rounds]


def ttft_figures(singles: list[Record], singles_httpx: list[Record]) -> dict[str, float]:
    """TTFT at one stream: client-measured, and pipeline-added (minus each request's own prefill)."""
    client_ttft = [s.ttft * 1e3 for s in singles]
    added, added_httpx = added_ms(singles), added_ms(singles_httpx)
    return {
        "ttft_1_stream_p50_ms": pct(client_ttft, 50),
        "ttft_1_stream_p99_ms": pct(client_ttft, 99),
        "added_ttft_p50_ms": pct(added, 50),
        "added_ttft_p99_ms": pct(added, 99),
        "added_ttft_httpx_p50_ms": pct(added_httpx, 50),
        "added_ttft_httpx_p99_ms": pct(added_httpx, 99),
    }


def pipeline_figures(runs: Runs, eng: dict[str, Any], streams: int, max_tokens: int) -> dict[str, Any]:
    client_ttft = [s.ttft * 1e3 for s in runs.singles]
    many = [r for batch, _ in runs.rounds for r in batch]
    round_tok_s, round_tok_s_httpx = _tok_s(runs.rounds), _tok_s(runs.rounds_httpx)
    return {
        **ttft_figures(runs.singles, runs.singles_httpx),
        "added_ttft_vs_engine_p50_ms": pct(client_ttft, 50) - eng["engine_ttft_p50_ms"],
        "added_ttft_vs_engine_p99_ms": pct(client_ttft, 99) - eng["engine_ttft_p99_ms"],
        "streams": streams,
        "tokens": sum(r.tokens for r in runs.rounds[0][0]),
        "wall_s": statistics.fmean(wall for _, wall in runs.rounds),
        "rounds_tok_s": round_tok_s,
        "tok_s": statistics.fmean(round_tok_s),
        "rounds_tok_s_httpx": round_tok_s_httpx,
        "tok_s_httpx": statistics.fmean(round_tok_s_httpx),
        "batches": sum(len(r.batch_tokens) for r in runs.rounds[0][0]),
        "ttft_many_p50_ms": pct([r.ttft * 1e3 for r in many], 50),
        "all_finished": all(r.finish == "length" and r.tokens == max_tokens
                            for batch, _ in runs.rounds + runs.rounds_httpx for r in batch),
    }


def stage_breakdown(recs: list[Record], q: float = 50) -> dict[str, float]:
    """The ``q``-th percentile (ms) of each stage of :data:`STAGES` over ``recs`` (NaN where no
    request has both stamps)."""
    out = {}
    for name, (a, b) in STAGES.items():
        vals = []
        for r in recs:
            stamps = {**r.first_timings, "start": r.start_ns, "arrival": r.first_arrival_ns}
            if stamps.get(a) and stamps.get(b):
                vals.append((stamps[b] - stamps[a]) / 1e6)
        out[name] = pct(vals, q) if vals else float("nan")
    return out


def ratios(pipe: dict[str, Any], eng: dict[str, Any]) -> dict[str, float]:
    return {
        "pipeline_vs_ceiling": pipe["tok_s"] / eng["ceiling_tok_s"],
        "pipeline_vs_engine": pipe["tok_s"] / eng["engine_tok_s"],
        "pipeline_httpx_vs_engine": pipe["tok_s_httpx"] / eng["engine_tok_s"],
        "engine_vs_ceiling": eng["engine_tok_s"] / eng["ceiling_tok_s"],
        "engine_vs_own_forward": eng["engine_tok_s"] / eng["own_forward_tok_s"],
        "bf16_vs_fp32_forward": eng["raw_forward_bf16_tok_s"] / eng["raw_forward_fp32_tok_s"],
        "hf_generate_vs_ceiling": eng["hf_generate_1_at_a_time_tok_s"] / eng["ceiling_tok_s"],
        "naive_vs_ceiling": eng["naive_no_kv_cache_tok_s"] / eng["ceiling_tok_s"],
    }


def goals(pipe: dict[str, Any], ratio: dict[str, float], eng: dict[str, Any]) -> dict[str, bool]:
    """The benchmark issue's goals, each met or not."""
    met = {"pipeline_vs_ceiling>=0.7": ratio["pipeline_vs_ceiling"] >= 0.7,
           "pipeline_vs_engine>=0.95": ratio["pipeline_vs_engine"] >= 0.95,
           "added_ttft_p50<=2ms": pipe["added_ttft_p50_ms"] <= 2.0,
           "added_ttft_p99<=10ms": pipe["added_ttft_p99_ms"] <= 10.0}
    for streams, row in eng["engine_sweep"].items():
        met[f"engine_{streams}_streams_vs_ceiling>=0.8"] = row["ratio"] >= 0.8
    return met
