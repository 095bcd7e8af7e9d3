"""A few end-to-end checks with the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from generator.model.loader import LoadedModel
from generator.service.worker import GeneratorWorker
from producer import Producer
from tokenpipe.bus import connect
from tokenpipe.settings import Settings

from .conftest import Preparation, RelayServer, prepare_together, read_sse
from .test_pipeline import in_process

pytestmark = pytest.mark.smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
async def smol_generator(settings: Settings, smollm2: LoadedModel) -> AsyncIterator[GeneratorWorker]:
    # The reference's own model: one load is one kernel table (a second load on a busy machine may
    # measure another, and another kernel's rounding can change a greedy token).
    bus = await connect(settings, name="test-smollm2")
    worker = GeneratorWorker(settings.replace(model="smollm2-135m"), smollm2, bus)
    await worker.start()
    yield worker
    await worker.stop(drain_timeout=1.0)
    await bus.close()


async def test_chat_over_http_answers_paris(smol_generator: GeneratorWorker, relay: RelayServer,
                                            smollm2: LoadedModel) -> None:
    async with httpx.AsyncClient(base_url=relay.url, timeout=120) as http:
        r = await http.post("/v1/streams", json={"model": "smollm2-135m", "messages": QUESTION, "max_tokens": 30,
                                                 "temperature": 0})
        assert r.status_code == 201, r.text
        async with http.stream("GET", f"/v1/streams/{r.json()['id']}") as resp:
            events = [(e, json.loads(d)) for e, _, d in await read_sse(resp)]
    text = "".join(d["text"] for e, d in events if e == "tokens")
    assert events[-1] == ("done", {"finish": "stop", "usage": events[-1][1]["usage"]})
    assert "Paris" in text
    from tokenpipe.wire import Request

    ref = Request.from_map({"v": 1, "id": "r", "model": "smollm2-135m", "messages": QUESTION,
                            "params": {"max_tokens": 30, "temperature": 0}})
    assert text == in_process(smollm2, ref)


@pytest.mark.parametrize("prompt, max_tokens, expect", [
    ("你好世界，你好世界，你好世界，", 6, "你好"),
    ("Emoji list: 😀 🎉 🚀 😀 🎉 🚀 😀 🎉", 12, "🚀"),
])
async def test_sdk_streams_emoji_and_cjk_intact(smol_generator: GeneratorWorker, settings: Settings,
                                                smollm2: LoadedModel, prompt: str, max_tokens: int,
                                                expect: str) -> None:
    async with await Producer.connect(settings=settings) as producer:
        handle = await producer.submit("smollm2-135m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       coalesce={"max_tokens": 0})  # one batch per token: worst case
        pieces = [t async for t in handle.text()]
        result = await handle.result()
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == result.text
    assert expect in result.text
    assert result.text == smollm2.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_regression_two_generators_preparing_one_fresh_data_dir_converted_at_once(
        cache_preparation: Preparation | None, tmp_path: Path) -> None:
    """Two processes preparing SmolLM2 in one fresh data dir (generators started together by hand)
    both converted it (twice the work) through the same ``.tmp`` directory, where one could remove
    what the other was writing or had just moved into place. Now one converts, under a lock beside
    the cache, and the other waits for it and uses its cache. (The session's own conversion is this
    scenario where the test cache started empty; else it runs here, in a fresh directory.)"""
    prep = cache_preparation or prepare_together(tmp_path)
    assert [code for code, _, _ in prep.procs] == [0, 0], [err[-2000:] for _, _, err in prep.procs]
    target = prep.data_dir / "models" / "smollm2-135m"
    assert [out.strip() for _, out, _ in prep.procs] == [str(target)] * 2
    assert sum(err.count("preparing smollm2-135m (one-time") for _, _, err in prep.procs) == 1
    assert (target / ".complete").exists() and not target.with_name("smollm2-135m.tmp").exists()
