"""The load generator counts what the stream delivered, over each API path."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.ascpu import PROFILES, masked_cpuinfo, missing, unavailable
from bench.rawhttp import SSEResponse
from generator.kernels.build import FLAGS as GEMV_FLAGS
from generator.model.loader import LoadedModel
from relay.sse import sse_event
from tokenpipe.settings import Settings
from tokenpipe_cli.loadgen import LoadConfig, run_load
from tokenpipe_cli.report import plot
from tokenpipe_cli.stats import summarize

from .conftest import RelayServer, run_bench


@pytest.mark.parametrize("api", ["native", "openai", "sdk"])
async def test_load_counts_every_token(relay: RelayServer, settings: Settings, api: str, tmp_path: Path) -> None:
    cfg = LoadConfig(url=relay.url, api=api, nats_url=settings.nats_url, model="tiny-random", concurrency=3,
                     num_requests=6, output_len="10-14", seed=1)
    records, wall = await run_load(cfg)
    s = summarize(records, wall)
    assert s["succeeded"] == 6 and s["failed"] == 0
    assert 60 <= s["output_tokens"] <= 84
    assert all(r.tokens == sum(r.batch_tokens) for r in records)
    assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"]
    assert s["tokens_per_batch"] >= 1
    plot(records, str(tmp_path / "cdf.png"), api)
    assert (tmp_path / "cdf.png").stat().st_size > 1000


async def test_poisson_rate_mode(relay: RelayServer) -> None:
    cfg = LoadConfig(url=relay.url, model="tiny-random", rate=50.0, num_requests=8, output_len="4")
    records, wall = await run_load(cfg)
    assert summarize(records, wall)["output_tokens"] == 32


@given(st.lists(st.text(max_size=30).filter(lambda t: "\r" not in t), max_size=6),
       st.lists(st.integers(0, 5000), max_size=12))
def test_the_minimal_http_client_reads_a_chunked_event_stream_split_anywhere(texts: list[str],
                                                                           cuts: list[int]) -> None:
    body_chunks = [sse_event({"text": t}, event="tokens", id=i) for i, t in enumerate(texts)]
    wire = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in body_chunks) + b"0\r\n\r\n")
    points = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    response = SSEResponse()
    events = [e for a, b in pairwise(points) for e in response.feed(wire[a:b])]
    assert response.status == 200 and response.ended
    assert [(e.event, e.id, e.json()) for e in events] == [("tokens", str(i), {"text": t}) for i, t in enumerate(texts)]


def test_pipeline_benchmark_and_gpu_summary_run_end_to_end(tmp_path: Path, data_dir: Path) -> None:
    """`make bench` and bench/gpu.sh's plumbing, on the tiny model (the real runs take minutes)."""
    out = tmp_path / "pipeline.json"
    proc = run_bench(["bench.pipeline", "--model", "tiny-random", "--dtype", "float32", "--streams", "4",
                 "--engine-batches", "2,4", "--max-tokens", "12", "--ttft-requests", "3", "--baseline-tokens", "4",
                 "--data-dir", str(data_dir), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["pipeline"]["all_finished"] and result["pipeline"]["tokens"] == 4 * 12
    assert set(result["goals"]) >= {"pipeline_vs_engine>=0.95", "added_ttft_p50<=2ms"}
    summary = tmp_path / "gpu.json"
    proc = run_bench(["bench.gpu_summary", str(out), "--out", str(summary)])
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(summary.read_text())
    assert row["model"] == "tiny-random" and row["pipeline_tok_s"] > 0 and set(row["sweep"]) == {"2", "4"}


def test_pipeline_benchmark_ttft_only_reports_the_added_ttft_and_its_stages(tmp_path: Path, data_dir: Path) -> None:
    """`bench.pipeline --only ttft`: the TTFT phase alone, no in-process engine; on an open bus and under
    tokenpipe's NATS accounts (the relay in its own), compared."""
    out = tmp_path / "ttft.json"
    proc = run_bench(["bench.pipeline", "--only", "ttft", "--model", "tiny-random", "--dtype", "float32",
                 "--ttft-requests", "3", "--bus", "open,accounts", "--data-dir", str(data_dir), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "engine" not in result and result["pipeline"]["added_ttft_p50_ms"] > 0
    assert set(result["stages_1_stream_p50_ms"]) == set(result["stages_1_stream_p99_ms"])
    assert result["stages_1_stream_p50_ms"]["prefill (admitted → first token)"] > 0
    assert set(result["buses"]) == {"open", "accounts"} and result["buses"]["accounts"]["added_ttft_p50_ms"] > 0
    assert result["bus_ratios"]["accounts"]["added_ttft_p50_ms"] > 0
    assert "TTFT at 1 stream by bus" in proc.stdout


def test_fanout_benchmark_forwards_every_batch(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    proc = run_bench(["bench.fanout", "--scenario", "20:4:50", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["scenarios"]
    assert len(runs) == 1
    for r in runs:
        assert r["batches_received"] == r["batches_expected"] == 80 and r["errors"] == 0
        lat, steady = r["added_latency_ms"], r["added_latency_steady_ms"]
        assert 0 < lat["p50"] <= lat["p99"] and 0 < steady["p50"] <= steady["p99"]
        assert r["steady_batches_s"] > 0  # (CPU per batch is not checked: 80 batches are below the clock tick)


def test_step_split_benchmark_times_the_step_and_the_rest(tmp_path: Path, data_dir: Path) -> None:
    """`bench.stepsplit`: whole steps and the rest (projections stubbed), and the bytes a step reads."""
    out = tmp_path / "stepsplit.json"
    proc = run_bench(["bench.stepsplit", "--model", "tiny-random", "--data-dir", str(data_dir), "--rows", "1,2",
                 "--rounds", "1", "--steps", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["splits"]] == [1, 2]
    assert all(r["step_ms"] > 0 and r["rest_ms"] > 0 for r in result["splits"])
    assert result["weight_bytes_per_token"] > 0 and result["bandwidth_share_one_row"] > 0


def test_gemv_rows_benchmark_checks_and_times_each_one_row_kernel(tmp_path: Path, data_dir: Path) -> None:
    """`bench.gemvrows`: each shape's product checked against the dequantized weight, then timed cached and streamed."""
    out = tmp_path / "gemvrows.json"
    proc = run_bench(["bench.gemvrows", "--data-dir", str(data_dir), "--rounds", "1", "--cached-mb", "0.1",
                 "--streamed-mb", "0.4", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["kind"], r["k"]) for r in result["shapes"]] == [("int4", 576), ("int4", 1536), ("int8", 576)]
    assert all(r["rel_err"] < 1e-2 and r["cached_gb_s"] > 0 and r["streamed_gb_s"] > 0 for r in result["shapes"])


def test_attention_benchmark_times_the_torch_ops_and_the_kernel(tmp_path: Path, data_dir: Path) -> None:
    """`bench.attention`: one layer's decode attention three ways, each checked against the kernel's result."""
    out = tmp_path / "attention.json"
    proc = run_bench(["bench.attention", "--model", "tiny-random", "--data-dir", str(data_dir), "--rows", "1,3",
                 "--context", "40", "--rounds", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["context"], r["rows"]) for r in result["results"]] == [(40, 1), (40, 3)]
    assert all(set(r["us"]) == {"bagged", "fp32", "kernel"} and min(r["us"].values()) > 0 for r in result["results"])


def test_accuracy_benchmark_scores_each_kernel_on_the_same_text(tmp_path: Path, data_dir: Path) -> None:
    """`bench.accuracy`: the loss of one text under each forced kernel; the float weight agrees with itself."""
    out = tmp_path / "accuracy.json"
    proc = run_bench(["bench.accuracy", "--model", "tiny-random", "--data-dir", str(data_dir), "--rows", "2",
                 "--tokens", "6", "--kernels", "dense,gemv,gemm8", "--out", str(out)],
                env={"TOKENPIPE_QUANT": "int4", "TOKENPIPE_DTYPE": "float32"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["dense", "gemv", "gemm8"] and results["dense"]["greedy_agrees"] == 1.0
    assert all(math.isfinite(r["nll"]) and r["nll"] > 0 and r["perplexity"] > 1 for r in results.values())


def test_sampling_benchmark_times_every_mode_and_row_count(tmp_path: Path, data_dir: Path) -> None:
    """`bench.sampling`: each sampling mode at each row count, against a step of as many rows."""
    out = tmp_path / "sampling.json"
    proc = run_bench(["bench.sampling", "--model", "tiny-random", "--data-dir", str(data_dir), "--rows", "1,3",
                 "--rounds", "1", "--calls", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["step_ms"] > 0 and set(r["sample_ms"]) == set(result["modes"])
        assert all(ms > 0 for ms in r["sample_ms"].values())


def test_stubbed_projections_are_put_back(tiny_model: LoadedModel) -> None:
    """The rest is timed with the projections swapped out; afterwards the model computes as before."""
    from bench.kvstep import RawSteps
    from bench.stepsplit import projections_stubbed
    from generator.model.plan import plan_for

    def logits() -> torch.Tensor:
        raw = RawSteps(tiny_model, 1, 16)
        raw.prefill(torch.tensor([[1, 2, 3]]))
        return raw.decode(torch.tensor([4]), torch.tensor([3]), 4)

    plan, cfg = plan_for(tiny_model.model), tiny_model.model.config
    before = logits()
    with projections_stubbed(plan, int(cfg.hidden_size), int(cfg.vocab_size)):
        assert not logits().any()  # every projection, lm_head included, returned zeros
    assert torch.equal(logits(), before)


def test_gpu_script_refuses_clearly_without_a_gpu() -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU: bench/gpu.sh would run for minutes")
    script = Path(__file__).parents[1] / "bench" / "gpu.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "no NVIDIA GPU" in proc.stderr


def test_gpu_script_parses_and_its_python_runs_its_cpu_fallback(tmp_path: Path) -> None:
    """bench/gpu.sh cannot run here: its syntax is checked, and `--dry-run` runs bench.cudagraphs on
    the CPU (tiny shapes, the eager decode; the captured one is refused with the fallback's reason)."""
    script = Path(__file__).parents[1] / "bench" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    proc = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PY": sys.executable, "OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu-cudagraphs-dry.json").read_text())["models"]["tiny-random"]
    assert all(rows["graphs_off"][b]["tok_s"] > 0 and rows["graphs_off"][b]["bw"] > 0 for b in ("1", "4"))
    assert "CUDA graphs need a CUDA device" in rows["graphs_on"]["skipped"]


def test_as_cpu_masks_only_the_flags_lines_and_only_the_profiles_flags() -> None:
    """`bench.ascpu`'s masking: a flags line loses AVX-512, AMX and AVX-VNNI for `avx2` and only AMX and
    FP16 (and VEX VNNI) for `avx512-bf16`; a line that merely mentions a flag is left as it is."""
    text = ("model name\t: Some CPU avx512f\nflags\t\t: fpu avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni "
            "avx_vnni amx_bf16 amx_tile amx_int8 avx512_fp16\nbugs\t\t: none\n")
    flags = {name: next(line for line in masked_cpuinfo(text, p).splitlines() if line.startswith("flags")).split()[2:]
             for name, p in PROFILES.items()}
    assert flags["avx2"] == ["fpu", "avx", "avx2", "fma"]
    assert flags["avx512-bf16"] == ["fpu", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"]
    assert masked_cpuinfo(text, PROFILES["avx2"]).splitlines()[0] == "model name\t: Some CPU avx512f"
    # a profile hides extensions and cannot add them: an AVX2-only CPU cannot stand in for Zen 4
    assert missing(PROFILES["avx2"], text) == [] and missing(PROFILES["avx512-bf16"], text) == []
    assert missing(PROFILES["avx512-bf16"], masked_cpuinfo(text, PROFILES["avx2"])) == [
        "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"]


def test_as_cpu_runs_a_command_that_sees_an_avx2_only_cpu_in_every_layer() -> None:
    """`python -m bench.ascpu avx2 -- ...`: the command's /proc/cpuinfo, the kernel library's build flags,
    the `auto` dtype's bf16 check and torch's ATen kernels all see AVX2 only. Where it cannot (no root,
    no mount namespace) it refuses with the reason, running nothing."""
    probe = ("import json, torch; from generator.kernels import build, cpu; from generator.model import loader; "
             "flags = cpu.cpu_info()[1]; "
             "print(json.dumps({'avx512': [f for f in flags if f.startswith(('avx512', 'amx'))], "
             "'build': list(build.build_flags(flags)), 'bf16': loader.cpu_has_fast_bf16(), "
             "'aten': torch.backends.cpu.get_cpu_capability()}))")
    proc = run_bench(["bench.ascpu", "avx2", "--", sys.executable, "-c", probe], timeout=120)
    reason = unavailable()
    if reason is not None:
        assert proc.returncode == 2 and reason in proc.stderr and proc.stdout == ""
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"avx512": [], "build": list(GEMV_FLAGS), "bf16": False, "aten": "AVX2"}


def test_llama_raw_benchmark_without_llama_cpp_says_how_to_install_it(tmp_path: Path) -> None:
    """`bench.llamaraw` with no llama-cpp-python virtualenv: exit 2, the path it looked at and where the
    install command is, and no JSON written."""
    out = tmp_path / "llamaraw.json"
    proc = run_bench(["bench.llamaraw", "--llama-python", str(tmp_path / "none" / "python"), "--out", str(out)],
                timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert str(tmp_path / "none" / "python") in proc.stdout and "bench/peers.py" in proc.stdout
    assert not out.exists()


def test_startup_benchmark_times_a_cold_and_a_warm_start(tmp_path: Path) -> None:
    """`bench.startup`: `tokenpipe up` on a fresh data dir, then again on it: both ready, the generator's
    kernel table final and its idle RSS read; llama.cpp reported as measured or not, with why."""
    out = tmp_path / "startup.json"
    proc = run_bench(["bench.startup", "--model", "tiny-random", "--generators", "1", "--table-timeout", "60",
                      "--llama-python", str(tmp_path / "no-python"), "--out", str(out),
                      "--variant", "fork:TOKENPIPE_FORK_GENERATORS=1",
                      "--variant", "spawn:TOKENPIPE_FORK_GENERATORS=0", "--restarts", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (rounds,) = result["rounds"]
    cold, warm = rounds["cold"], rounds["warm"]
    assert 0 < cold["nats_s"] < cold["ready_s"] and warm["ready_s"] > 0
    # The variants' warm starts, alternated on the same data dir, each ready, the first's ratio 1.
    fork, spawned = result["variants"]
    assert (fork["name"], spawned["name"]) == ("fork", "spawn") and fork["ratio"] == 1.0
    assert len(fork["after_nats_s"]) == len(spawned["after_nats_s"]) == 1 and spawned["median_s"] > 0
    assert [len(fork["restart_s"]), len(spawned["restart_s"])] == [1, 1] and fork["restart_median_s"] > 0
    assert "warm starts, alternated" in proc.stdout
    assert cold["table_final_s"] is not None  # an unquantized model's rules are final at once
    assert all(mb > 50 for mb in [*cold["idle_rss_mb"].values(), *warm["idle_rss_mb"].values()])
    assert result["llamacpp"]["measured"] is False and "not installed" in result["llamacpp"]["why"]
