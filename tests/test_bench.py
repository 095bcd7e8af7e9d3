"""The load generator counts what the stream delivered, over each API path."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.loadgen import LoadConfig, plot, run_load, summarize
from tokenpipe.settings import Settings

from .conftest import RelayServer


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
