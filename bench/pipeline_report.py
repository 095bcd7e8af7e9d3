"""The pipeline benchmark's tables: throughput against the ceiling, the engine sweep, TTFT,
the first batch's stages, the goals."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render", "render_ttft"]


def render(r: dict[str, Any], console: Console) -> None:
    """The tables of a finished run (the dict that is also written as JSON)."""
    for table in (_throughput(r), _sweep(r["engine"]), _ttft(r["engine"], r["pipeline"]), _stages(r), _goals(r)):
        console.print(table)
    console.print(f"batches {r['pipeline']['batches']} for {r['pipeline']['tokens']} tokens")


def render_ttft(r: dict[str, Any], console: Console) -> None:
    """The tables of a ``--only ttft`` run: TTFT at one stream and where the first batch's time went."""
    console.print(_ttft(None, r["pipeline"]))
    t = Table(title="First batch at 1 stream: where the time went (ms)")
    for col in ("stage", "p50", "p99"):
        t.add_column(col, justify="right" if col != "stage" else "left")
    for name, v in r["stages_1_stream_p50_ms"].items():
        t.add_row(name, f"{v:.2f}", f"{r['stages_1_stream_p99_ms'][name]:.2f}")
    console.print(t)
    if "buses" in r:
        buses = Table(title="TTFT at 1 stream by bus (ms; ratio to the first)")
        for col in ("bus", "TTFT p50", "added p50", "added p99", "relay → generator p50", "generator → client p50",
                    "× added p50"):
            buses.add_column(col, justify="right" if col != "bus" else "left")
        for bus, f in r["buses"].items():
            ratio = r["bus_ratios"].get(bus, {}).get("added_ttft_p50_ms", 1.0)
            stages = f["stages_1_stream_p50_ms"]
            buses.add_row(bus, f"{f['ttft_1_stream_p50_ms']:.2f}", f"{f['added_ttft_p50_ms']:.2f}",
                          f"{f['added_ttft_p99_ms']:.2f}", f"{stages['relay → generator (built → received)']:.2f}",
                          f"{stages['generator → client (emitted → first SSE event)']:.2f}", f"{ratio:.2f}")
        console.print(buses)
    met = r["pipeline"]["added_ttft_p50_ms"] <= 2.0
    console.print(f"added_ttft_p50<=2ms: {r['pipeline']['added_ttft_p50_ms']:.2f} ms — "
                  + ("[green]met[/]" if met else "[red]not met[/]"))


def _throughput(r: dict[str, Any]) -> Table:
    eng, pipe = r["engine"], r["pipeline"]
    n = r["config"]["streams"]
    t = Table(title=f"tokenpipe pipeline benchmark — {r['config']['model']}, {n} streams × "
                    f"{r['config']['max_tokens']} tokens, {r['machine']['cpu_count']} CPUs")
    t.add_column("what")
    t.add_column("tok/s", justify="right")
    t.add_column("× ceiling", justify="right")
    ceiling = eng["ceiling_tok_s"]
    rows = [
        (f"raw forward step, batch {n}, fp32 (ceiling candidate)", eng["raw_forward_fp32_tok_s"]),
        (f"raw forward step, batch {n}, bf16 (ceiling candidate)", eng["raw_forward_bf16_tok_s"]),
        (f"tokenpipe's own decode step alone, batch {n}, {eng['engine_dtype']}", eng["own_forward_tok_s"]),
        (f"tokenpipe engine in-process, {n} streams (mean of before/after the pipeline)", eng["engine_tok_s"]),
        (f"full pipeline HTTP→NATS→generator→NATS→SSE, {n} streams, minimal client "
         f"(mean of {len(pipe['rounds_tok_s'])})", pipe["tok_s"]),
        (f"the same through httpx (mean of {len(pipe['rounds_tok_s_httpx'])}, alternating)", pipe["tok_s_httpx"]),
        ("HF generate, one request at a time", eng["hf_generate_1_at_a_time_tok_s"]),
        ("naive loop without KV cache, batch 1", eng["naive_no_kv_cache_tok_s"]),
    ]
    for name, v in rows:
        t.add_row(name, f"{v:,.1f}", f"{v / ceiling:.2f}")
    if "gemm_peak_gflops" in eng:
        t.caption = (f"decode step batch {n}: {eng['own_forward_gflops']:.0f} GFLOP/s = "
                     f"{eng['own_forward_gflops'] / eng['gemm_peak_gflops']:.0%} of the measured "
                     f"{eng['engine_dtype']} GEMM peak ({eng['gemm_peak_gflops']:.0f} GFLOP/s, same threads); "
                     f"weights: {eng.get('engine_quant', 'none')}")
    return t


def _sweep(eng: dict[str, Any]) -> Table:
    t = Table(title="Engine in-process vs the raw forward step at the same batch (best of fp32/bf16)")
    for col in ("streams", "raw step tok/s", "engine tok/s", "ratio (goal ≥ 0.8)"):
        t.add_column(col, justify="right")
    for streams, row in eng["engine_sweep"].items():
        t.add_row(streams, f"{row['ceiling_tok_s']:.1f}", f"{row['engine_tok_s']:.1f}", f"{row['ratio']:.2f}")
    return t


def _ttft(eng: dict[str, Any] | None, pipe: dict[str, Any]) -> Table:
    t = Table(title="TTFT at 1 stream (ms)")
    for col in ("", "p50", "p99"):
        t.add_column(col, justify="right" if col else "left")
    if eng is not None:  # not measured by a ``--only ttft`` run
        t.add_row("engine in-process (prefill)", f"{eng['engine_ttft_p50_ms']:.1f}",
                  f"{eng['engine_ttft_p99_ms']:.1f}")
    t.add_row("full pipeline (client-measured, minimal HTTP client)", f"{pipe['ttft_1_stream_p50_ms']:.1f}",
              f"{pipe['ttft_1_stream_p99_ms']:.1f}")
    t.add_row("pipeline-added (per request, batch timestamps)", f"{pipe['added_ttft_p50_ms']:.1f}",
              f"{pipe['added_ttft_p99_ms']:.1f}")
    t.add_row("the same through httpx (client library included)", f"{pipe['added_ttft_httpx_p50_ms']:.1f}",
              f"{pipe['added_ttft_httpx_p99_ms']:.1f}")
    return t


def _stages(r: dict[str, Any]) -> Table:
    t = Table(title="First batch: where the time went (p50 ms)")
    t.add_column("stage")
    t.add_column("1 stream", justify="right")
    t.add_column(f"{r['config']['streams']} streams", justify="right")
    for name, v in r["stages_1_stream_p50_ms"].items():
        t.add_row(name, f"{v:.1f}", f"{r['stages_32_streams_p50_ms'][name]:.1f}")
    return t


def _goals(r: dict[str, Any]) -> Table:
    eng, pipe, ratio = r["engine"], r["pipeline"], r["ratios"]
    measured = {"pipeline_vs_ceiling>=0.7": f"{ratio['pipeline_vs_ceiling']:.2f}",
                "pipeline_vs_engine>=0.95": f"{ratio['pipeline_vs_engine']:.2f} "
                                            f"(httpx {ratio['pipeline_httpx_vs_engine']:.2f})",
                "added_ttft_p50<=2ms": f"{pipe['added_ttft_p50_ms']:.1f} ms",
                "added_ttft_p99<=10ms": f"{pipe['added_ttft_p99_ms']:.1f} ms"}
    for streams, row in eng["engine_sweep"].items():
        measured[f"engine_{streams}_streams_vs_ceiling>=0.8"] = f"{row['ratio']:.2f}"
    t = Table(title="Goals")
    for col in ("goal", "measured", ""):
        t.add_column(col)
    for name, met in r["goals"].items():
        t.add_row(name, measured.get(name, ""), "[green]met[/]" if met else "[red]not met[/]")
    return t
