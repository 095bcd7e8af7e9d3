"""`make bench`: the whole pipeline against the raw batched forward ceiling, in one run.

    python -m bench.pipeline [--streams 32] [--max-tokens 128] [--out bench/out/pipeline.json]

Runs, in order: in-process reference points (raw forward step at the stream count, fp32 and
bf16; our engine; HF generate one at a time; the naive no-KV-cache loop), then starts a real
nats-server, a generator process and a relay process and drives them over HTTP/SSE:
TTFT at one stream (pipeline-added = client TTFT minus the engine's own prefill time, per
request, from the batch timestamps) and aggregate tokens/s at ``--streams`` concurrent
streams. Every comparison is a ratio within this run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from generator.models import LoadedModel, load_model
from tokenpipe.natsserver import NatsServer, free_port
from tokenpipe.settings import Settings

from . import ceilings
from .loadgen import Record, feed_native_sse, native_stream, percentile

console = Console()
TOPICS = ["a lighthouse", "the moon", "a robot", "coffee", "rivers", "a library", "winter", "trains", "bees",
          "the ocean", "a violin", "mountains", "a city at night", "gardens", "a storm", "friendship"]


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})."}]


def pct(values: list[float], q: float) -> float:
    return percentile(sorted(values), q / 100)


async def one_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> Record:
    """One request over the native API, timed from the POST (the load generator's own path)."""
    rec = Record(ok=False, start=time.perf_counter())
    await native_stream(client, body, rec)
    rec.e2e = time.perf_counter() - rec.start
    rec.ok = rec.finish in ("length", "stop")
    return rec


async def raw_stream(url: str, body: dict[str, Any]) -> Record:
    """:func:`one_stream` with a minimal HTTP/1.1 client on asyncio streams, for the TTFT probe
    and the concurrent phase, so that a client library's own overhead (httpx adds ~0.6 ms to a
    POST here, and its CPU competes with the engine) is not counted as the pipeline's."""
    host, port = url.removeprefix("http://").split(":")
    rec = Record(ok=False, start=time.perf_counter())
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/streams HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        sid = json.loads(await reader.readexactly(length))["id"]
        writer.write(f"GET /v1/streams/{sid} HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n".encode())
        event, ended = "", False
        while not ended:
            raw = await reader.readline()
            if not raw:
                break  # connection closed before the end of the stream
            event, ended = feed_native_sse(rec, event, raw.decode().strip())
    finally:
        writer.close()
    rec.e2e = time.perf_counter() - rec.start
    rec.ok = rec.finish in ("length", "stop")
    return rec


class Pipeline:
    """nats-server + one generator process + one relay process, for the benchmark's lifetime."""

    def __init__(self, model: str, data_dir: str, extra_env: dict[str, str] | None = None,
                 device: str = "auto", dtype: str = "auto") -> None:
        self.device = device
        self.dtype = dtype
        self.tmp = tempfile.TemporaryDirectory(prefix="tokenpipe-bench-")
        self.nats = NatsServer(Path(self.tmp.name) / "nats")
        self.port = free_port()
        self.model = model
        self.data_dir = data_dir
        self.env = {**os.environ, **(extra_env or {})}
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Pipeline:
        self.nats.start()
        common = ["--nats-url", self.nats.url, "--data-dir", self.data_dir, "--log-level", "WARNING"]
        log = open(Path(self.tmp.name) / "roles.log", "wb")
        roles = (["generator", "--model", self.model, "--device", self.device, "--dtype", self.dtype],
                 ["relay", "--port", str(self.port)])
        for role in roles:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tokenpipe", role[0], *common, *role[1:]],
                                               env=self.env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)  # waiting for child processes to become ready
        self.__exit__()
        raise RuntimeError("pipeline did not become ready; see " + str(Path(self.tmp.name) / "roles.log"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.nats.stop()
        self.tmp.cleanup()


async def drive(url: str, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.streams * 2 + 4, max_keepalive_connections=args.streams * 2 + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        # warm-up: first request pays one-time costs (thread pools, allocator)
        await one_stream(client, {"messages": chat(999), **base, "max_tokens": 8})
        task = progress.add_task("TTFT at 1 stream", total=args.ttft_requests)
        singles, singles_httpx = [], []
        for i in range(args.ttft_requests):  # interleaved, so both clients see the same conditions
            singles.append(await raw_stream(url, {"messages": chat(i), **base, "max_tokens": 4}))
            singles_httpx.append(await one_stream(client, {"messages": chat(i), **base, "max_tokens": 4}))
            progress.advance(task)
        task = progress.add_task(f"{args.streams} concurrent streams × {args.repeats} × 2 clients",
                                 total=args.streams * args.repeats * 2)

        async def tracked(i: int, httpx_client: bool) -> Record:
            body = {"messages": chat(i), **base}
            res = await (one_stream(client, body) if httpx_client else raw_stream(url, body))
            progress.advance(task)
            return res

        # A short burst first, like the in-process engine had (its sweep ran these batch shapes).
        await asyncio.gather(*(one_stream(client, {"messages": chat(i), **base, "max_tokens": 4})
                               for i in range(args.streams)))
        # The minimal client measures the pipeline; httpx, alternating with it, what a client
        # library adds (on 2 cores its CPU is taken from the engine's OpenMP team too).
        rounds: list[tuple[list[Record], float]] = []
        rounds_httpx: list[tuple[list[Record], float]] = []
        for _ in range(args.repeats):
            for httpx_client, out in ((False, rounds), (True, rounds_httpx)):
                t0 = time.perf_counter()
                many = await asyncio.gather(*(tracked(i, httpx_client) for i in range(args.streams)))
                out.append((many, time.perf_counter() - t0))
    return {"singles": singles, "singles_httpx": singles_httpx, "rounds": rounds, "rounds_httpx": rounds_httpx}


def measure_engine(lm: LoadedModel, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    tok = lm.tokenizer
    most = max([args.streams, *args.engine_batches])
    prompts = [tok.apply_chat_template(chat(i), add_generation_prompt=True, tokenize=True)["input_ids"]
               for i in range(most)]
    prompt_len = round(statistics.mean(len(p) for p in prompts))
    context = prompt_len + args.max_tokens // 2
    out: dict[str, Any] = {"prompt_tokens_mean": prompt_len, "ceiling_context": context}
    task = progress.add_task("in-process reference points", total=5 + len(args.engine_batches))
    other = "float32" if lm.dtype == torch.bfloat16 else "bfloat16"
    lm_other = load_model(args.model, device=args.device, dtype=other, data_dir=args.data_dir)
    by_dtype = {str(lm.dtype).removeprefix("torch."): lm, other: lm_other}
    out["raw_forward_fp32_tok_s"] = ceilings.raw_forward_tok_s(by_dtype["float32"], args.streams, context)
    out["raw_forward_bf16_tok_s"] = ceilings.raw_forward_tok_s(by_dtype["bfloat16"], args.streams, context)
    out["own_forward_tok_s"] = ceilings.own_forward_tok_s(lm, args.streams, context)
    out["engine_dtype"] = str(lm.dtype).removeprefix("torch.")
    out["engine_sweep"] = {}
    for n in args.engine_batches:
        # Engine goal of the benchmark issue: aggregate decode tok/s at n streams vs the raw step at batch n.
        ceiling = max(ceilings.raw_forward_tok_s(m, n, context) for m in by_dtype.values())
        run = ceilings.engine_tok_s(lm, prompts[:n], args.max_tokens, max_batch=n)
        out["engine_sweep"][str(n)] = {"ceiling_tok_s": ceiling, "engine_tok_s": run.tok_s,
                                       "ratio": run.tok_s / ceiling}
        progress.advance(task)
    del lm_other, by_dtype
    gc.collect()
    progress.advance(task)
    out["ceiling_tok_s"] = max(out["raw_forward_fp32_tok_s"], out["raw_forward_bf16_tok_s"])
    run = ceilings.engine_tok_s(lm, prompts[: args.streams], args.max_tokens, max_batch=args.streams)
    out["engine_tok_s_before"] = run.tok_s
    out["engine_wall_s"] = run.wall_s
    progress.advance(task)
    ttfts = [ceilings.engine_tok_s(lm, [prompts[i % len(prompts)]], 1, max_batch=1).ttft_s
             for i in range(args.ttft_requests)]
    out["engine_ttft_p50_ms"] = pct(ttfts, 50) * 1e3
    out["engine_ttft_p99_ms"] = pct(ttfts, 99) * 1e3
    progress.advance(task)
    out["hf_generate_1_at_a_time_tok_s"] = ceilings.hf_generate_tok_s(lm, prompts[0], args.baseline_tokens, 1)
    progress.advance(task)
    out["naive_no_kv_cache_tok_s"] = ceilings.naive_no_cache_tok_s(lm, prompts[0], args.baseline_tokens // 2)
    progress.advance(task)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="engine dtype: auto, bfloat16, float16 or float32")
    parser.add_argument("--engine-batches", type=lambda v: [int(x) for x in v.split(",")], default=[8, 32, 64],
                        help="stream counts for the engine-vs-ceiling sweep (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the concurrent-streams phase (mean)")
    parser.add_argument("--baseline-tokens", type=int, default=32)
    parser.add_argument("--data-dir", default=Settings.load().data_dir)
    parser.add_argument("--out", default="bench/out/pipeline.json")
    parser.add_argument("--gen-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the generator and relay processes (repeatable)")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    with Progress(console=console, transient=False) as progress:
        lm = load_model(args.model, device=args.device, dtype=args.dtype, data_dir=args.data_dir)
        results["engine"] = eng = measure_engine(lm, args, progress)
        extra_env = dict(kv.split("=", 1) for kv in args.gen_env)
        with Pipeline(args.model, args.data_dir, extra_env, args.device, args.dtype) as pipe:
            runs = asyncio.run(drive(pipe.url, args, progress))
        # The engine again, after the pipeline: this machine's speed drifts (shared cores), so the
        # pipeline is compared with the mean of the engine measured before and after it.
        prompts = [lm.tokenizer.apply_chat_template(chat(i), add_generation_prompt=True, tokenize=True)["input_ids"]
                   for i in range(args.streams)]
        after = ceilings.engine_tok_s(lm, prompts, args.max_tokens, max_batch=args.streams)
        eng["engine_tok_s_after"] = after.tok_s
        eng["engine_tok_s"] = (eng["engine_tok_s_before"] + after.tok_s) / 2
        del lm
        gc.collect()

    eng = results["engine"]
    singles: list[Record] = runs["singles"]
    rounds: list[tuple[list[Record], float]] = runs["rounds"]
    rounds_httpx: list[tuple[list[Record], float]] = runs["rounds_httpx"]
    many = [r for batch, _ in rounds for r in batch]
    client_ttft = [s.ttft * 1e3 for s in singles]

    def added_ms(recs: list[Record]) -> list[float]:
        # Per request: client TTFT minus the engine's own part (prefill: admitted -> first token).
        return [s.ttft * 1e3 - (s.first_timings["first_token"] - s.first_timings["admitted"]) / 1e6
                for s in recs if "admitted" in s.first_timings]

    added = added_ms(singles)
    added_httpx = added_ms(runs["singles_httpx"])
    round_tok_s = [sum(r.tokens for r in batch) / wall for batch, wall in rounds]
    round_tok_s_httpx = [sum(r.tokens for r in batch) / wall for batch, wall in rounds_httpx]
    total_tokens = sum(r.tokens for r in rounds[0][0])
    pipe_tok_s = statistics.fmean(round_tok_s)
    results["pipeline"] = {
        "ttft_1_stream_p50_ms": pct(client_ttft, 50),
        "ttft_1_stream_p99_ms": pct(client_ttft, 99),
        "added_ttft_p50_ms": pct(added, 50),
        "added_ttft_p99_ms": pct(added, 99),
        "added_ttft_httpx_p50_ms": pct(added_httpx, 50),
        "added_ttft_httpx_p99_ms": pct(added_httpx, 99),
        "added_ttft_vs_engine_p50_ms": pct(client_ttft, 50) - eng["engine_ttft_p50_ms"],
        "added_ttft_vs_engine_p99_ms": pct(client_ttft, 99) - eng["engine_ttft_p99_ms"],
        "streams": args.streams,
        "tokens": total_tokens,
        "wall_s": statistics.fmean(wall for _, wall in rounds),
        "rounds_tok_s": round_tok_s,
        "tok_s": pipe_tok_s,
        "rounds_tok_s_httpx": round_tok_s_httpx,
        "tok_s_httpx": statistics.fmean(round_tok_s_httpx),
        "batches": sum(len(r.batch_tokens) for r in rounds[0][0]),
        "ttft_many_p50_ms": pct([r.ttft * 1e3 for r in many], 50),
        "all_finished": all(r.finish == "length" and r.tokens == args.max_tokens
                            for batch, _ in rounds + rounds_httpx for r in batch),
    }
    results["stages_32_streams_p50_ms"] = stage_breakdown(many)
    results["stages_1_stream_p50_ms"] = stage_breakdown(singles)
    results["ratios"] = {
        "pipeline_vs_ceiling": pipe_tok_s / eng["ceiling_tok_s"],
        "pipeline_vs_engine": pipe_tok_s / eng["engine_tok_s"],
        "pipeline_httpx_vs_engine": results["pipeline"]["tok_s_httpx"] / eng["engine_tok_s"],
        "engine_vs_ceiling": eng["engine_tok_s"] / eng["ceiling_tok_s"],
        "engine_vs_own_forward": eng["engine_tok_s"] / eng["own_forward_tok_s"],
        "bf16_vs_fp32_forward": eng["raw_forward_bf16_tok_s"] / eng["raw_forward_fp32_tok_s"],
        "hf_generate_vs_ceiling": eng["hf_generate_1_at_a_time_tok_s"] / eng["ceiling_tok_s"],
        "naive_vs_ceiling": eng["naive_no_kv_cache_tok_s"] / eng["ceiling_tok_s"],
    }
    results["goals"] = {"pipeline_vs_ceiling>=0.7": results["ratios"]["pipeline_vs_ceiling"] >= 0.7,
                        "pipeline_vs_engine>=0.95": results["ratios"]["pipeline_vs_engine"] >= 0.95,
                        "added_ttft_p50<=2ms": results["pipeline"]["added_ttft_p50_ms"] <= 2.0,
                        "added_ttft_p99<=10ms": results["pipeline"]["added_ttft_p99_ms"] <= 10.0}
    for streams, row in eng["engine_sweep"].items():
        results["goals"][f"engine_{streams}_streams_vs_ceiling>=0.8"] = row["ratio"] >= 0.8
    render(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")
    return 0 if results["pipeline"]["all_finished"] else 1


def stage_breakdown(runs: list[Record]) -> dict[str, float]:
    """Where the first batch's time went, from the timestamps it carries and the client's own
    wall clock at the POST and at the first event (same host clock)."""
    spans = {"client → relay (POST → request built)": ("start", "created"),
             "relay → generator (built → received)": ("created", "received"),
             "generator → engine (received → admitted)": ("received", "admitted"),
             "prefill (admitted → first token)": ("admitted", "first_token"),
             "coalescer (first token → emitted)": ("first_token", "emitted"),
             "generator → client (emitted → first SSE event)": ("emitted", "arrival")}
    out = {}
    for name, (a, b) in spans.items():
        vals = []
        for r in runs:
            stamps = {**r.first_timings, "start": r.start_ns, "arrival": r.first_arrival_ns}
            if stamps.get(a) and stamps.get(b):
                vals.append((stamps[b] - stamps[a]) / 1e6)
        out[name] = pct(vals, 50) if vals else float("nan")
    return out


def render(r: dict[str, Any]) -> None:
    eng, pipe, ratio = r["engine"], r["pipeline"], r["ratios"]
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
    console.print(t)
    sweep = Table(title="Engine in-process vs the raw forward step at the same batch (best of fp32/bf16)")
    for col in ("streams", "raw step tok/s", "engine tok/s", "ratio (goal ≥ 0.8)"):
        sweep.add_column(col, justify="right")
    for streams, row in eng["engine_sweep"].items():
        sweep.add_row(streams, f"{row['ceiling_tok_s']:.1f}", f"{row['engine_tok_s']:.1f}", f"{row['ratio']:.2f}")
    console.print(sweep)
    lat = Table(title="TTFT at 1 stream (ms)")
    for col in ("", "p50", "p99"):
        lat.add_column(col, justify="right" if col else "left")
    lat.add_row("engine in-process (prefill)", f"{eng['engine_ttft_p50_ms']:.1f}", f"{eng['engine_ttft_p99_ms']:.1f}")
    lat.add_row("full pipeline (client-measured, minimal HTTP client)", f"{pipe['ttft_1_stream_p50_ms']:.1f}",
                f"{pipe['ttft_1_stream_p99_ms']:.1f}")
    lat.add_row("pipeline-added (per request, batch timestamps)", f"{pipe['added_ttft_p50_ms']:.1f}",
                f"{pipe['added_ttft_p99_ms']:.1f}")
    lat.add_row("the same through httpx (client library included)", f"{pipe['added_ttft_httpx_p50_ms']:.1f}",
                f"{pipe['added_ttft_httpx_p99_ms']:.1f}")
    console.print(lat)
    st = Table(title="First batch: where the time went (p50 ms)")
    st.add_column("stage")
    st.add_column("1 stream", justify="right")
    st.add_column(f"{n} streams", justify="right")
    for name, v in r["stages_1_stream_p50_ms"].items():
        st.add_row(name, f"{v:.1f}", f"{r['stages_32_streams_p50_ms'][name]:.1f}")
    console.print(st)
    measured = {"pipeline_vs_ceiling>=0.7": f"{ratio['pipeline_vs_ceiling']:.2f}",
                "pipeline_vs_engine>=0.95": f"{ratio['pipeline_vs_engine']:.2f} "
                                            f"(httpx {ratio['pipeline_httpx_vs_engine']:.2f})",
                "added_ttft_p50<=2ms": f"{pipe['added_ttft_p50_ms']:.1f} ms",
                "added_ttft_p99<=10ms": f"{pipe['added_ttft_p99_ms']:.1f} ms"}
    for streams, row in eng["engine_sweep"].items():
        measured[f"engine_{streams}_streams_vs_ceiling>=0.8"] = f"{row['ratio']:.2f}"
    goals = Table(title="Goals")
    for col in ("goal", "measured", ""):
        goals.add_column(col)
    for name, met in r["goals"].items():
        goals.add_row(name, measured.get(name, ""), "[green]met[/]" if met else "[red]not met[/]")
    console.print(goals)
    console.print(f"batches {pipe['batches']} for {pipe['tokens']} tokens")


if __name__ == "__main__":
    sys.exit(main())
