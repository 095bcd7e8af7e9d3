"""Load generator against a running pipeline, reporting what `vllm bench serve` reports.

Modes: a fixed number of concurrent clients, or Poisson arrivals at a request rate; stop
after N requests or a duration. Paths: the native SSE API, the OpenAI API (streaming chat
completions), or the producer SDK straight on NATS. Tokens are counted from the stream (not
chunks). Coalesced batches are measured as such: inter-batch latency and tokens per batch;
per-token ITL spreads a batch's gap evenly over its tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

__all__ = ["LoadConfig", "Record", "latency_stats", "native_stream", "percentile", "plot", "record_batch", "run_load",
           "summarize", "feed_native_sse"]

WORDS = ["stream", "token", "queue", "batch", "relay", "model", "prompt", "answer", "latency", "window", "cache",
         "replay", "resume", "worker", "subject", "message", "server", "client", "trace", "metric"]


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    api: str = "native"  # native | openai | sdk
    nats_url: str = "nats://127.0.0.1:4222"
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    rate: float | None = None  # requests/s (Poisson); overrides concurrency when set
    num_requests: int = 64
    duration_s: float | None = None
    prompt_words: int = 24
    output_len: str = "128"  # "N" or "A-B" (uniform)
    coalesce_max_tokens: int | None = None
    coalesce_max_delay_ms: float | None = None
    seed: int = 0


@dataclass
class Record:
    ok: bool
    start: float
    ttft: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # seconds since start, per batch
    batch_tokens: list[int] = field(default_factory=list)
    first_timings: dict[str, int] = field(default_factory=dict)
    start_ns: int = field(default_factory=time.time_ns)  # wall clock at start (batch stamps are wall clock)
    first_arrival_ns: int = 0


def _output_len(spec: str, rng: random.Random) -> int:
    if "-" in spec:
        lo, hi = (int(x) for x in spec.split("-", 1))
        return rng.randint(lo, hi)
    return int(spec)


def _prompt(rng: random.Random, words: int) -> str:
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def native_stream(client: httpx.AsyncClient, body: dict[str, Any], rec: Record) -> None:
    """POST /v1/streams then read its SSE to the end, recording every batch into ``rec``."""
    r = await client.post("/v1/streams", json=body)
    r.raise_for_status()
    sid = r.json()["id"]
    event = ""
    async with client.stream("GET", f"/v1/streams/{sid}") as resp:
        async for line in resp.aiter_lines():
            event, ended = feed_native_sse(rec, event, line)
            if ended:
                return


def feed_native_sse(rec: Record, event: str, line: str) -> tuple[str, bool]:
    """One line of the native API's SSE into ``rec``: returns the current event name and
    whether the stream ended (``done`` or ``error``)."""
    if line.startswith("event:"):
        return line[6:].strip(), False
    if line.startswith("data:"):
        data = json.loads(line[5:])
        if event == "tokens":
            record_batch(rec, len(data["token_ids"]), data.get("timings"))
        elif event in ("done", "error"):
            rec.finish = data.get("finish", "error")
            rec.error = data.get("message")
            return event, True
    return event, False


async def _openai(client: httpx.AsyncClient, body: dict[str, Any], rec: Record) -> None:
    msgs = [{"role": "user", "content": body.pop("prompt")}]
    req = {**body, "messages": msgs, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=req) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                rec.finish, rec.error = "error", chunk["error"]["message"]
                return
            if chunk.get("usage"):
                # OpenAI chunks do not say how many tokens each carries: spread the usage count over them.
                total, n = chunk["usage"]["completion_tokens"], len(rec.batch_tokens)
                if n:
                    rec.batch_tokens = [total // n + (1 if i < total % n else 0) for i in range(n)]
                rec.tokens = total
            elif chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                record_batch(rec, 1, None)
            if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                rec.finish = chunk["choices"][0]["finish_reason"]


def record_batch(rec: Record, ntok: int, timings: dict[str, int] | None) -> None:
    """Note one batch's arrival (the first one sets TTFT and the stage timestamps)."""
    now = time.perf_counter() - rec.start
    if not rec.arrivals:
        rec.ttft = now
        rec.first_timings = timings or {}
        rec.first_arrival_ns = time.time_ns()
    rec.arrivals.append(now)
    rec.batch_tokens.append(ntok)
    rec.tokens += ntok


async def _sdk(producer: Any, body: dict[str, Any], rec: Record) -> None:
    model = body.pop("model")
    handle = await producer.submit(model, **body)
    async for batch in handle:
        record_batch(rec, len(batch.token_ids), dict(batch.timings))
        if batch.is_final:
            rec.finish, rec.error = batch.finish, batch.error


async def run_load(cfg: LoadConfig, progress: Any = None) -> tuple[list[Record], float]:
    """Drive the pipeline; returns the per-request records and the wall time."""
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=cfg.url, timeout=600, limits=limits, headers=headers)
    producer = None
    model = cfg.model
    if cfg.api == "sdk":
        from producer import Producer

        producer = await Producer.connect(cfg.nats_url)
        model = model or "smollm2-135m"
    elif model is None:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    records: list[Record] = []
    task = progress.add_task(f"{cfg.api} load", total=cfg.num_requests) if progress else None

    async def one() -> None:
        body: dict[str, Any] = {"model": model, "prompt": _prompt(rng, cfg.prompt_words),
                                "max_tokens": _output_len(cfg.output_len, rng), "temperature": 0,
                                "ignore_eos": True}
        if cfg.coalesce_max_tokens is not None or cfg.coalesce_max_delay_ms is not None:
            if cfg.api == "openai":
                raise ValueError("coalescing overrides need the native API or the SDK")
            body["coalesce"] = {"max_tokens": cfg.coalesce_max_tokens, "max_delay_ms": cfg.coalesce_max_delay_ms}
        rec = Record(ok=False, start=time.perf_counter())
        try:
            if cfg.api == "native":
                await native_stream(client, body, rec)
            elif cfg.api == "openai":
                await _openai(client, body, rec)
            else:
                await _sdk(producer, body, rec)
            rec.ok = rec.finish in ("length", "stop")
        except (httpx.HTTPError, OSError) as exc:
            rec.error = repr(exc)
        rec.e2e = time.perf_counter() - rec.start
        records.append(rec)
        if progress is not None:
            progress.advance(task)

    t0 = time.perf_counter()
    deadline = t0 + cfg.duration_s if cfg.duration_s else float("inf")
    try:
        if cfg.rate:
            tasks = []
            for _ in range(cfg.num_requests):
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(rng.expovariate(cfg.rate))  # Poisson arrivals
            await asyncio.gather(*tasks)
        else:
            remaining = cfg.num_requests

            async def worker() -> None:
                nonlocal remaining
                while remaining > 0 and time.perf_counter() < deadline:
                    remaining -= 1
                    await one()

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    finally:
        await client.aclose()
        if producer is not None:
            await producer.close()
    return records, time.perf_counter() - t0


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted list (NaN when empty)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def latency_stats(values: list[float], scale: float = 1e3) -> dict[str, float]:
    vals = sorted(v * scale for v in values if v == v)
    if not vals:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {"mean": statistics.fmean(vals), "p50": percentile(vals, 0.5), "p90": percentile(vals, 0.9),
            "p99": percentile(vals, 0.99)}


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    itl: list[float] = []
    inter_batch: list[float] = []
    for r in ok:
        for prev, cur, n in zip(r.arrivals, r.arrivals[1:], r.batch_tokens[1:], strict=False):
            inter_batch.append(cur - prev)
            itl.extend([(cur - prev) / n] * n if n else [])
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
        "wall_s": wall, "request_throughput": len(ok) / wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "ttft_ms": latency_stats([r.ttft for r in ok]), "tpot_ms": latency_stats(tpot),
        "itl_ms": latency_stats(itl), "e2e_ms": latency_stats([r.e2e for r in ok]),
        "inter_batch_ms": latency_stats(inter_batch),
        "tokens_per_batch": statistics.fmean([n for r in ok for n in r.batch_tokens]) if ok else float("nan"),
        "batches": sum(len(r.batch_tokens) for r in ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def plot(records: list[Record], path: str, title: str) -> None:
    """Latency CDFs (TTFT, ITL, E2E) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft * 1e3 for r in ok], "E2E": [r.e2e * 1e3 for r in ok],
              "ITL": [(c - p) / n * 1e3 for r in ok
                      for p, c, n in zip(r.arrivals, r.arrivals[1:], r.batch_tokens[1:], strict=False) if n]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, vals) in zip(axes, series.items(), strict=True):
        vals = sorted(vals)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / tokens")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def records_json(records: list[Record]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
