"""Batch work alone costs nothing (bench.lanes' ``rate`` part): the tokens/s of ``--rate-streams``
streams at the default tier, the same streams as ``flex``, and a Batch API batch of as many lines
(``POST /v1/files`` + ``/v1/batches``), alternated by round on one stack.

The streams are created and read over SSE at once; a case's time runs from its first request to its
last token. The batch's runs from ``POST /v1/batches`` until its record reads ``completed`` (polled
every 0.1 s, under 1 % of a run of several seconds) and its tokens are the output file's
``usage.completion_tokens``. Every request is greedy with ``ignore_eos``: each case decodes the
same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from .common import alternate, chat
from .rawhttp import raw_stream

__all__ = ["RATE_CASES", "print_rate", "rate_scenario"]

RATE_CASES = ("default", "flex", "batch-api")
_POLL_S = 0.1


async def _streams(url: str, tier: str, args: argparse.Namespace, api_key: str) -> tuple[int, float]:
    """Tokens and seconds of ``--rate-streams`` streams at ``tier``, all at once."""
    body = {"temperature": 0, "ignore_eos": True, "max_tokens": args.rate_tokens, "service_tier": tier}
    start = time.perf_counter()
    recs = await asyncio.gather(*(raw_stream(url, {"messages": chat(200 + i), **body}, api_key)
                                  for i in range(args.rate_streams)))
    seconds = time.perf_counter() - start
    bad = [r.error or r.finish for r in recs if not r.ok or r.tokens != args.rate_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of the {tier} streams did not decode {args.rate_tokens} tokens: {bad[:3]}")
    return sum(r.tokens for r in recs), seconds


async def _batch(url: str, args: argparse.Namespace, api_key: str) -> tuple[int, float]:
    """Tokens and seconds of a Batch API batch of ``--rate-streams`` lines."""
    body = {"temperature": 0, "ignore_eos": True, "max_tokens": args.rate_tokens}
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": chat(200 + i), **body}}) + "\n"
                    for i in range(args.rate_streams))
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as client:
        f = await client.post("/v1/files", files={"file": ("rate.jsonl", lines.encode())}, data={"purpose": "batch"})
        f.raise_for_status()
        start = time.perf_counter()
        b = await client.post("/v1/batches", json={"input_file_id": f.json()["id"],
                                                   "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        b.raise_for_status()
        batch = b.json()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(_POLL_S)  # the Batch API has no push: its record is polled, as clients do
            batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
        seconds = time.perf_counter() - start
        counts = batch["request_counts"]
        if batch["status"] != "completed" or counts["completed"] != args.rate_streams:
            raise RuntimeError(f"the batch ended {batch['status']} with {counts}")
        out = await client.get(f"/v1/files/{batch['output_file_id']}/content")
        rows = [json.loads(line) for line in out.text.splitlines() if line.strip()]
    tokens = sum(row["response"]["body"]["usage"]["completion_tokens"] for row in rows)
    if tokens != args.rate_streams * args.rate_tokens:
        raise RuntimeError(f"the batch decoded {tokens} tokens, not {args.rate_streams * args.rate_tokens}")
    return tokens, seconds


async def rate_scenario(url: str, args: argparse.Namespace, api_key: str, console: Console) -> dict[str, Any]:
    """Each case's tokens/s by round, their medians and each median over the default tier's."""
    samples: dict[str, list[float]] = {c: [] for c in RATE_CASES}
    for r in range(args.rounds):
        for case in alternate(RATE_CASES, r):
            tokens, seconds = await (_batch(url, args, api_key) if case == "batch-api"
                                     else _streams(url, case, args, api_key))
            samples[case].append(tokens / seconds)
            console.print(f"  round {r + 1} {case}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s")
    medians = {c: statistics.median(v) for c, v in samples.items()}
    return {"tokens_per_s": samples, "tokens_per_s_median": medians,
            "over_default": {c: medians[c] / medians["default"] for c in RATE_CASES}}


def print_rate(rate: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"work alone: {args.rate_streams} x {args.rate_tokens} tokens, {args.max_batch} slots "
                        f"({args.model})")
    for col in ("case", "tok/s p50", "x default"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for c in RATE_CASES:
        table.add_row(c, f"{rate['tokens_per_s_median'][c]:.1f}", f"{rate['over_default'][c]:.3f}")
    console.print(table)
