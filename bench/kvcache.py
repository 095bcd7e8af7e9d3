"""The paged KV cache's own figures: memory, prefix caching, decode against context (issue 20).

``python -m bench.kvcache [--model smollm2-135m] [--quick] [--only up-memory|throughput] [--out F]``:
(a) KV bytes written against the bytes the positions need, and engine RSS, under a mixed-length load
(in a fresh process), and the generator's RSS through ``tokenpipe up`` (the issue's growth and peak
goal); (b) TTFT with a shared ~1,100-token system prompt, cold vs warm, and a 6-turn conversation turn
by turn; (c) decode tok/s against context length at 1 and 32 streams; (d) 32-stream throughput;
(e) the most concurrent streams one budget holds for a realistic length mix. Prints tables, writes
``bench/out/kvcache.json``. Apart from the two ``tokenpipe up`` parts, everything runs in-process
on the engine (no NATS): these are the cache's own numbers. (The slot cache it replaced, and the
A/B against it, were removed; docs/perf-history.md has their last figures.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from generator.engine.scheduler import Engine
from generator.model.kvcache import BLOCK_SIZE, bytes_per_position
from generator.model.loader import LoadedModel, load_model, resolve_threads
from tokenpipe.settings import Settings
from tokenpipe.wire import SamplingParams

from .common import cpu_summary, rss_kib, write_json

console = Console(stderr=True)
OUT = Path(__file__).with_name("out") / "kvcache.json"
MIX = [1600, *([96, 160, 220, 300] * 8)][:32]  # one long prompt and 31 short ones (the RSS goal)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(100, 40_000) for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, int]:
    seqs = [engine.new_sequence(f"s{i}", p, _greedy(new)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    t0 = time.perf_counter()
    engine.run_to_completion()
    return time.perf_counter() - t0, sum(len(s.generated) for s in seqs)


def _load(model: str) -> LoadedModel:
    """The model as a generator with these settings loads it (device, dtype, quant, threads)."""
    s = Settings.load()
    torch.set_num_threads(resolve_threads(s.threads))
    return load_model(model, device=s.device, dtype=s.dtype, quant=s.quant, data_dir=s.data_dir)


def memory_child(model: str) -> dict[str, Any]:
    """(a), in a fresh process: RSS before the engine, after building it, after the mixed load."""
    lm = _load(model)
    idle = (rss_kib(os.getpid()) * 1024)
    engine = Engine(lm, max_batch=32)
    built = (rss_kib(os.getpid()) * 1024)
    _run(engine, [_prompt(n, i) for i, n in enumerate(MIX)], 16)
    per_pos = bytes_per_position(lm.model, lm.dtype)
    held = sum(MIX) + 16 * len(MIX)
    kv = engine.cache.touched_bytes
    return {"rss_idle_mb": idle / 2**20, "rss_built_mb": built / 2**20,
            "rss_after_mb": (rss_kib(os.getpid()) * 1024) / 2**20, "kv_written_mb": kv / 2**20,
            "kv_needed_mb": held * per_pos / 2**20,
            "kv_over_needed": kv / (held * per_pos)}


def memory(model: str) -> dict[str, Any]:
    """(a) in a child process, so that its RSS is the engine's and the mixed load's alone."""
    console.print("(a) memory: in a child process")
    res = subprocess.run([sys.executable, "-m", "bench.kvcache", "--model", model, "--memory-child"],
                         capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


def ttft(lm: LoadedModel, system_len: int) -> dict[str, Any]:
    """(b) TTFT (prefill + first token) with a shared system prompt, and a 6-turn conversation."""
    system = _prompt(system_len, 7)
    times = {}
    for caching in (False, True):
        engine = Engine(lm, max_batch=4, prefix_caching=caching)
        per = []
        for q in range(4):
            seq = engine.new_sequence(f"q{q}", [*system, *_prompt(20, 100 + q)], _greedy(1))
            engine.add(seq)
            t0 = time.perf_counter()
            engine.run_to_completion()
            per.append(time.perf_counter() - t0)
        times["off" if not caching else "on"] = per
    engine = Engine(lm, max_batch=4)
    history: list[int] = list(system[:200])
    turns = []
    for turn in range(6):
        history += _prompt(40, 200 + turn)
        seq = engine.new_sequence(f"t{turn}", list(history), _greedy(60))
        engine.add(seq)
        t0 = time.perf_counter()
        engine.step()  # admission + prefill: the first token
        turns.append(time.perf_counter() - t0)
        engine.run_to_completion()
        history += seq.generated
    return {"system_tokens": system_len, "cold_s": times["on"][0], "warm_s": statistics.median(times["on"][1:]),
            "no_cache_s": statistics.median(times["off"][1:]), "turns_s": turns,
            "warm_over_cold": statistics.median(times["on"][1:]) / times["on"][0],
            "turn6_over_turn1": turns[-1] / turns[0]}


def decode_curve(lm: LoadedModel, contexts: list[int], streams: list[int], steps: int) -> list[dict[str, Any]]:
    """(c) decode tok/s of the engine against context length."""
    rows = []
    for n in streams:
        for ctx in contexts:
            engine = Engine(lm, max_batch=n, max_seq_len=ctx + steps + 8, prefix_caching=False)
            seqs = [engine.new_sequence(f"c{i}", _prompt(ctx, 1000 * n + i), _greedy(steps)) for i in range(n)]
            for s in seqs:
                engine.add(s)
            while any(not s.generated for s in seqs):
                engine.step()  # prefill (in waves) until every row decodes
            t0 = time.perf_counter()
            before = sum(len(s.generated) for s in seqs)
            engine.run_to_completion()
            done = sum(len(s.generated) for s in seqs) - before
            rows.append({"streams": n, "context": ctx, "tok_s": done / (time.perf_counter() - t0)})
            console.print(f"(c) {n} streams, context {ctx}: {rows[-1]['tok_s']:.0f} tok/s")
    return rows


def throughput(lm: LoadedModel, rounds: int, new: int) -> dict[str, Any]:
    """(d) 32 streams to completion, ``rounds`` times in this process: the median tok/s."""
    # short prompts: the time goes to decode (a 1-thread prefill of 32 x 160 tokens took most of a run)
    prompts = [_prompt(n, 50 + i) for i, n in enumerate([16, 24, 32, 48] * 8)]
    rates: list[float] = []
    for r in range(rounds):
        wall, tokens = _run(Engine(lm, max_batch=32), prompts, new)
        rates.append(tokens / wall)
        console.print(f"(d) round {r + 1}/{rounds}: {tokens / wall:.0f} tok/s")
    return {"tok_s": statistics.median(rates), "rounds_tok_s": rates}


def capacity(lm: LoadedModel, budget_mb: float) -> dict[str, Any]:
    """(e) streams one budget holds at once: chat-like lengths (prompt 100-1,200, answer 50-400)."""
    rnd = random.Random(3)
    per_pos = bytes_per_position(lm.model, lm.dtype)
    lengths = [rnd.randint(100, 1200) + rnd.randint(50, 400) for _ in range(4096)]
    blocks = int(budget_mb * 2**20 // (per_pos * BLOCK_SIZE)) - 1
    paged, used = 0, 0
    for n in lengths:
        need = -(-n // BLOCK_SIZE)
        if used + need > blocks:
            break
        used, paged = used + need, paged + 1
    return {"budget_mb": budget_mb, "mean_len": statistics.mean(lengths[:paged]), "streams": paged}


def up_ttft(model: str) -> dict[str, Any]:
    """(b) through ``tokenpipe up`` over HTTP: a chat with a ~1,200-token system prompt, then four
    more with the same system prompt and other questions; TTFT is the POST to the first content."""
    import tempfile

    import httpx

    from tokenpipe_cli.launch import free_port

    port = free_port()
    tmp = tempfile.TemporaryDirectory()
    proc = subprocess.Popen([sys.executable, "-m", "tokenpipe_cli", "up", "--model", model, "--port", str(port),
                             "--nats-port", str(free_port()), "--data-dir", str(_up_data_dir(tmp.name))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    system = _RULES
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "is up" in line:
                break
        times = []
        for q in ("What is NATS?", "Name a colour.", "How far is the moon?", "What is 2+2?", "Who wrote Hamlet?"):
            body = {"model": model, "stream": True, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            t0 = time.perf_counter()
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"content"' in line and '"content":""' not in line:
                        break
            times.append(time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)
        tmp.cleanup()
    return {"cold_s": times[0], "warm_s": times[1:], "warm_over_cold": statistics.median(times[1:]) / times[0]}


def _up_data_dir(tmp: str) -> Path:
    """A fresh data dir for ``tokenpipe up`` that reuses this machine's converted models (never
    the default data dir: a bench run must not leave state there)."""
    data = Path(tmp) / "data"
    data.mkdir()
    models = Path(Settings.load().data_dir).resolve() / "models"
    models.mkdir(parents=True, exist_ok=True)  # a fresh clone has none yet: a dangling link made `up` fail
    (data / "models").symlink_to(models)
    return data


_RULES = " ".join(f"Rule {i}: answer politely, cite the source, and keep it short." for i in range(95))


def _chat(model: str, user: str, max_tokens: int, system: str | None = None) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "messages": messages}


def up_memory(model: str, interval_s: float = 0.1) -> dict[str, Any]:
    """(a) through ``tokenpipe up`` (defaults, one generator): the generator's RSS sampled every
    ``interval_s`` while three chats with a ~1,200-token system prompt run one after another,
    then one ~1,600-token prompt and 31 short streams at once; growth is the peak over idle."""
    import asyncio
    import tempfile
    import threading

    import httpx

    from tokenpipe_cli.upprocess import UpProcess

    async def run(up: UpProcess, pid: int) -> dict[str, Any]:
        samples: list[tuple[float, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(interval_s):
                samples.append((time.monotonic(), rss_kib(pid)))

        idle = max(rss_kib(pid) for _ in range(5) if not done.wait(0.2))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        marks: dict[str, float] = {}

        async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
            chunks = 0
            async with client.stream("POST", f"{up.url}/v1/chat/completions", json=body, timeout=1800) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    chunks += line.startswith("data:") and '"content"' in line
            return chunks

        try:
            async with httpx.AsyncClient() as client:
                for q in ("What is NATS?", "Name a colour.", "How far is the moon?"):
                    await stream(client, _chat(model, q, 8, _RULES))
                marks["chats_done"] = time.monotonic()
                long_text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river."
                                     for i in range(100))  # ~1,600 tokens
                bodies = [_chat(model, f"Summarise: {long_text}", 16)]
                bodies += [_chat(model, f"Question {i}: name a city starting with {chr(65 + i % 26)}.", 32)
                           for i in range(31)]
                await asyncio.gather(*(stream(client, b) for b in bodies))
        finally:
            done.set()
            sampler.join()
        peak = max(kib for _, kib in samples)
        after_chats = max((kib for t, kib in samples if t <= marks.get("chats_done", 0)), default=idle)
        return {"rss_idle_mb": idle / 1024, "rss_after_chats_mb": after_chats / 1024, "rss_peak_mb": peak / 1024,
                "growth_mb": (peak - idle) / 1024, "samples": len(samples)}

    async def main() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            up = UpProcess(_up_data_dir(tmp), "--model", model)
            try:
                await up.wait_up(900)
                pid = next(r["pid"] for r in up.status()["roles"] if r["name"].startswith("generator"))
                return await run(up, pid)
            finally:
                await up.stop()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="shorter curve (context to 2k) and 2 throughput rounds")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["up-memory", "throughput"], help="run one part and print it")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.model)))
        return
    if args.only:
        print(json.dumps(_only(args.only, args.model, args.quick), indent=2))
        return
    results: dict[str, Any] = {"cpu": cpu_summary(), "model": args.model}
    results["memory"] = memory(args.model)
    results["memory_up"] = up_memory(args.model)
    console.print(f"(a) through tokenpipe up: {results['memory_up']}")
    lm = _load(args.model)
    results["dtype"], results["quant"], results["threads"] = str(lm.dtype), lm.quant, torch.get_num_threads()
    results["ttft"] = ttft(lm, 1100)
    results["ttft_up"] = up_ttft(args.model)
    console.print(f"(b) through tokenpipe up: {results['ttft_up']}")
    results["throughput"] = throughput(lm, 2 if args.quick else 4, 64)
    # 32 streams of 8k positions are a 262k-token prefill: minutes on a small CPU, so the 32-stream
    # curve stops at 1k here (and at the model's context everywhere).
    top = lm.max_context - 32  # room for the decoded tokens
    one = sorted({min(c, top) for c in ([128, 512, 2048] if args.quick else [128, 512, 2048, 8192])})
    many = sorted({min(c, top) for c in [128, 512, 1024]})
    results["decode"] = decode_curve(lm, one, [1], 8) + decode_curve(lm, many, [32], 8)
    results["capacity"] = capacity(lm, 1024)
    write_json(args.out, results)
    report(results)


def _only(part: str, model: str, quick: bool) -> dict[str, Any]:
    """One part of the bench, for iterating on it (``--only``)."""
    out: dict[str, Any] = {"cpu": cpu_summary(), "model": model}
    if part == "up-memory":
        out["memory_up"] = up_memory(model)
    else:
        lm = _load(model)
        out["dtype"], out["threads"] = str(lm.dtype), torch.get_num_threads()
        out["throughput"] = throughput(lm, 2 if quick else 6, 64)
    return out


def report(r: dict[str, Any]) -> None:
    out = Console()
    out.print(f"CPU: {r['cpu']}; model {r['model']} {r['dtype']} quant={r['quant']}, {r['threads']} threads")
    t = Table(title="(a) KV memory under a mixed load (1 x 1,600 + 31 short prompts, 16 new tokens each)")
    for col in ("KV written MB", "KV needed MB", "written/needed", "RSS idle MB", "RSS engine built MB",
                "RSS after MB"):
        t.add_column(col)
    m = r["memory"]
    t.add_row(f"{m['kv_written_mb']:.0f}", f"{m['kv_needed_mb']:.0f}", f"{m['kv_over_needed']:.2f}",
              f"{m['rss_idle_mb']:.0f}", f"{m['rss_built_mb']:.0f}", f"{m['rss_after_mb']:.0f}")
    out.print(t)
    mu = r["memory_up"]
    out.print(f"(a) through `tokenpipe up`: generator RSS idle {mu['rss_idle_mb']:.0f} MB, after the chats "
              f"{mu['rss_after_chats_mb']:.0f} MB, peak {mu['rss_peak_mb']:.0f} MB, growth {mu['growth_mb']:.0f} MB")
    up = r["ttft_up"]
    out.print(f"(b) through `tokenpipe up` over HTTP: cold {up['cold_s'] * 1e3:.0f} ms, warm "
              + ", ".join(f"{w * 1e3:.0f}" for w in up["warm_s"]) + f" ms ({up['warm_over_cold']:.2f}x)")
    tt = r["ttft"]
    out.print(f"(b) TTFT, {tt['system_tokens']}-token shared system prompt: cold {tt['cold_s'] * 1e3:.0f} ms, warm "
              f"{tt['warm_s'] * 1e3:.0f} ms ({tt['warm_over_cold']:.2f}x; cache off {tt['no_cache_s'] * 1e3:.0f} ms); "
              "6 turns: " + ", ".join(f"{s * 1e3:.0f}" for s in tt["turns_s"])
              + f" ms (turn 6 / turn 1 = {tt['turn6_over_turn1']:.2f})")
    t = Table(title="(c) decode tok/s against context")
    for col in ("streams", "context", "tok/s"):
        t.add_column(col)
    for d in r["decode"]:
        t.add_row(str(d["streams"]), str(d["context"]), f"{d['tok_s']:.0f}")
    out.print(t)
    th = r["throughput"]
    out.print(f"(d) 32 streams: {th['tok_s']:.0f} tok/s (median; per round: "
              f"{', '.join(f'{x:.0f}' for x in th['rounds_tok_s'])})")
    c = r["capacity"]
    out.print(f"(e) {c['budget_mb']:.0f} MB holds {c['streams']} streams of mean {c['mean_len']:.0f} positions")


if __name__ == "__main__":
    main()
