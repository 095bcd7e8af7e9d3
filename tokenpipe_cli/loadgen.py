"""The load generator behind ``tokenpipe bench``: drives a running pipeline, records every request.

Modes: a fixed number of concurrent clients, or Poisson arrivals at a request rate; stop
after N requests or a duration. Paths: the native SSE API, the OpenAI API (streaming chat
completions), or the producer SDK straight on NATS. Tokens are counted from the stream (not
chunks), and each batch's arrival is kept, so coalesced batches are measured as such
(:mod:`tokenpipe_cli.stats` turns the records into what `vllm bench serve` reports).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from producer import Producer, RelayClient, SSEEvent, aiter_sse
from tokenpipe.errors import ConfigError, TokenpipeError

__all__ = ["LoadConfig", "Record", "native_stream", "record_batch", "record_event", "run_load"]

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


async def native_stream(relay: RelayClient, body: dict[str, Any], rec: Record) -> None:
    """POST /v1/streams then read its SSE to the end, recording every batch into ``rec``."""
    sid = await relay.create(body)
    async for event in relay.events(sid):
        if record_event(rec, event):
            return


def record_event(rec: Record, event: SSEEvent) -> bool:
    """One event of the native API into ``rec``; True when it ended the stream (``done`` or ``error``)."""
    if event.event == "tokens":
        data = event.json()
        record_batch(rec, len(data["token_ids"]), data.get("timings"))
    elif event.event in ("done", "error"):
        data = event.json()
        rec.finish = data.get("finish", "error")
        rec.error = data.get("message")
        return True
    return False


async def _openai(client: httpx.AsyncClient, body: dict[str, Any], rec: Record) -> None:
    msgs = [{"role": "user", "content": body.pop("prompt")}]
    req = {**body, "messages": msgs, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=req) as resp:
        resp.raise_for_status()
        async for event in aiter_sse(resp):
            if event.data == "[DONE]":
                continue
            chunk = event.json()
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


async def _sdk(producer: Producer, body: dict[str, Any], rec: Record) -> None:
    model = body.pop("model")
    handle = await producer.submit(model, **body)
    async for batch in handle:
        record_batch(rec, len(batch.token_ids), dict(batch.timings))
        if batch.is_final:
            rec.finish, rec.error = batch.finish, batch.error


async def run_load(cfg: LoadConfig, progress: Any = None) -> tuple[list[Record], float]:
    """Drive the pipeline; returns the per-request records and the wall time."""
    coalesce = cfg.coalesce_max_tokens is not None or cfg.coalesce_max_delay_ms is not None
    if coalesce and cfg.api == "openai":
        raise ConfigError("coalescing overrides need the native API or the SDK", param="api")
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=cfg.url, timeout=600, limits=limits, headers=headers)
    relay = RelayClient(http=client)
    producer = None
    model = cfg.model
    if cfg.api == "sdk":
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
        if coalesce:
            body["coalesce"] = {"max_tokens": cfg.coalesce_max_tokens, "max_delay_ms": cfg.coalesce_max_delay_ms}
        rec = Record(ok=False, start=time.perf_counter())
        try:
            if cfg.api == "native":
                await native_stream(relay, body, rec)
            elif cfg.api == "openai":
                await _openai(client, body, rec)
            else:
                assert producer is not None
                await _sdk(producer, body, rec)
            rec.ok = rec.finish in ("length", "stop")
        except (TokenpipeError, httpx.HTTPError, OSError) as exc:
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
