"""The inspector page (``/inspect``) in a real headless Chromium, served by ``tokenpipe up`` run as a
user runs it (a subprocess, API keys for two tenants, tracing on): the list (only the caller's
tenant's, live), selecting and replaying a stream, its timeline (one mark per batch, numbers on
hover), compare, export and import — and no console errors.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenpipe.streamrecord import build
from tokenpipe.wire import StreamMeta, TokenBatch
from tokenpipe_cli.upprocess import UpProcess

from .conftest import read_sse
from .test_browser import TIMEOUT_MS, Tab, browser  # noqa: F401  (the browser fixture)

pytestmark = pytest.mark.timeout(300)

TOKENPIPE = str(Path(sys.executable).parent / "tokenpipe")
KEY_A, KEY_B = "inspect-key-a", "inspect-key-b"
TRACE_URL = "http://jaeger.example/trace/{trace_id}"
SCREENSHOT = Path("/tmp/tokenpipe-inspect.png")
PROMPT = "Compare these two runs."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    data = tmp_path_factory.mktemp("inspect")
    (data / "models").symlink_to(data_dir / "models", target_is_directory=True)
    env = {**os.environ, "TOKENPIPE_THREADS": "1", "TOKENPIPE_DTYPE": "float32",
           "TOKENPIPE_API_KEYS": f"{KEY_A}:team-a,{KEY_B}:team-b", "TOKENPIPE_TRACE_URL": TRACE_URL,
           "OTEL_TRACES_EXPORTER": "console", "TOKENPIPE_COALESCE_MAX_TOKENS": "3"}
    env.pop("TOKENPIPE_METRICS_PORT", None)
    up = UpProcess(data, "--model", "tiny-random", env=env, command=[TOKENPIPE])
    try:
        await up.wait_up()
        yield up
        assert await up.stop() == 0, up.output()[-4000:]
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.fixture
async def api(stack: UpProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        yield http


async def run_stream(http: httpx.AsyncClient, key: str, **body: Any) -> str:
    r = await http.post("/v1/streams", headers=auth(key), json={"prompt": PROMPT, **body})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    async with http.stream("GET", f"/v1/streams/{sid}", headers=auth(key)) as resp:
        assert (await read_sse(resp))[-1][0] == "done"
    return str(sid)


async def export(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    r = await http.get(f"/v1/streams/{sid}/export", headers=auth(KEY_A))
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture
async def tab(browser: Any, stack: UpProcess) -> AsyncIterator[Tab]:  # noqa: F811
    """``/inspect`` with tenant A's key already given (the page keeps it in localStorage)."""
    context = await browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    await context.add_init_script(f"localStorage.setItem('tokenpipe.apiKey', {json.dumps(KEY_A)})")
    page = await context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    t = Tab(page)
    page.on("console", lambda msg: t.errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: t.errors.append(f"pageerror: {exc}"))
    resp = await page.goto(stack.url + "/inspect")
    assert resp is not None and resp.status == 200
    yield t
    await context.close()


def divergence(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    ta = [t for x in a["batches"] for t in x["token_ids"]]
    tb = [t for x in b["batches"] for t in x["token_ids"]]
    n = min(len(ta), len(tb))
    i = next((k for k in range(n) if ta[k] != tb[k]), n)
    return None if i == n and len(ta) == len(tb) else i


async def test_page_asks_for_a_key_when_keys_are_on(browser: Any, stack: UpProcess) -> None:  # noqa: F811
    context = await browser.new_context()
    try:
        page = await context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(stack.url + "/inspect")
        await page.wait_for_function("() => document.getElementById('status').textContent === 'API key required'")
        assert await page.is_visible("#apikey")
        await page.fill("#apikey", KEY_B)
        await page.dispatch_event("#apikey", "change")
        await page.wait_for_function("() => document.getElementById('status').textContent.includes('streams')")
        assert errors == []
    finally:
        await context.close()


async def test_list_replay_timeline_compare_export_import(tab: Tab, api: httpx.AsyncClient, tmp_path: Path) -> None:
    page = tab.page
    one = await run_stream(api, KEY_A, max_tokens=16, temperature=0.9, seed=1)
    two = await run_stream(api, KEY_A, max_tokens=24, temperature=0.9, seed=1)  # the same run, longer
    foreign = await run_stream(api, KEY_B, max_tokens=4)
    row = "#rows tr[data-id='{}']"
    await page.wait_for_selector(row.format(one))
    await page.wait_for_selector(row.format(two))
    assert await page.locator(row.format(foreign)).count() == 0  # the other tenant's stream never shows

    # Live: a stream started after the page loaded appears, and its row turns "length" when it ends.
    created = await api.post("/v1/streams", headers=auth(KEY_A),
                             json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    late = created.json()["id"]
    await page.wait_for_selector(row.format(late))
    await page.wait_for_function(f"() => document.querySelector(\"{row.format(late)}\").textContent.includes('length')",
                                 timeout=60_000)

    # Select: the stream replays batch by batch (paced, fast), its timeline has one mark per batch.
    rec = await export(api, one)
    await page.fill("#speed", "50")
    await page.click(row.format(one) + " td.sid")
    await page.wait_for_function("() => document.body.dataset.replay === 'done'")
    assert await page.text_content("#d-id") == one
    assert await page.locator("#text span.b").count() == len(rec["batches"])
    assert await page.locator("#text").text_content() == "".join(b["text"] for b in rec["batches"])
    assert await page.locator("#timeline .batch-mark").count() == len(rec["batches"])
    assert await page.locator("#timeline .batch-mark.played").count() == len(rec["batches"])
    assert await page.locator("#timeline .prefill").count() == 1
    assert await page.text_content("#s-tokens") == "16"
    assert await page.text_content("#s-batches") == str(len(rec["batches"]))
    assert json.loads(await page.text_content("#d-request") or "")["params"]["max_tokens"] == 16
    assert rec["trace_id"] and len(rec["trace_id"]) == 32
    assert await page.get_attribute("#d-trace a", "href") == TRACE_URL.format(trace_id=rec["trace_id"])
    # The numbers on hover. Regression (a hovered batch mark showed the gap after it): the next
    # "between" rect starts at the mark and was drawn on top of its hit area. Hover the hit's
    # left edge so a next batch emitted within a few pixels cannot cover it either.
    on_top = await page.evaluate("""() => [...document.querySelectorAll('#timeline .hit')].every((h) => {
        const r = h.getBoundingClientRect();
        return document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2).classList.contains('hit'); })""")
    assert on_top, "something drawn over a batch mark's hit area"
    await page.hover("#timeline .hit >> nth=0", position={"x": 1, "y": 10})
    assert await page.is_visible("#tip")
    assert (await page.text_content("#tip") or "").startswith("batch 0: ")

    # Export: the file is the relay's document; imported back, the page shows the same stream.
    async with page.expect_download() as info:
        await page.click("#export")
    saved = tmp_path / "exported.json"
    await (await info.value).save_as(saved)
    assert json.loads(saved.read_text()) == rec
    await page.click(row.format(two) + " td.sid")  # something else on screen first
    await page.wait_for_function(f"() => document.getElementById('d-id').textContent === '{two}'")
    await page.select_option("#mode", "instant")
    await page.set_input_files("#import", str(saved))
    await page.wait_for_function("() => document.getElementById('d-source').textContent === 'imported from a file'")
    assert await page.text_content("#d-id") == one
    assert await page.locator("#imported tr[data-id]").count() == 1
    await page.wait_for_function("() => document.body.dataset.replay === 'done'")
    assert await page.locator("#text").text_content() == "".join(b["text"] for b in rec["batches"])
    assert await page.locator("#timeline .batch-mark").count() == len(rec["batches"])

    # Compare two runs of the same prompt: where their tokens first differ, both timelines on one axis.
    other = await export(api, two)
    await page.check(row.format(one) + " input.pick")
    await page.check(row.format(two) + " input.pick")
    await page.click("#compare")
    await page.wait_for_function("() => !document.getElementById('cmp').hidden")
    expected = divergence(rec, other)
    index = await page.get_attribute("#diverge", "data-index")
    assert index == ("" if expected is None else str(expected)), await page.text_content("#diverge")
    assert await page.locator("#cmp-timeline .batch-mark").count() == len(rec["batches"]) + len(other["batches"])
    assert await page.locator("#cmp-a span.b").count() == len(rec["batches"])
    await page.screenshot(path=str(SCREENSHOT), full_page=True)
    await page.click(row.format(one) + " td.sid")
    await page.wait_for_function("() => document.body.dataset.replay === 'done'")
    await page.screenshot(path=str(SCREENSHOT.with_name("tokenpipe-inspect-one.png")), full_page=True)
    assert tab.errors == []


async def test_gaps_and_errors_are_marked_in_an_imported_stream(tab: Tab, tmp_path: Path) -> None:
    """A stream whose batch 1 is missing and which ended in error, as a bug report's attachment."""
    ms = 1_000_000
    t = 1_764_000_000_000_000_000
    batches = {0: TokenBatch(id="broken", seq=0, index=0, token_ids=(1, 2), text="ab",
                             timings={"created": t, "received": t + ms, "admitted": t + 2 * ms,
                                      "first_token": t + 9 * ms, "emitted": t + 10 * ms}),
               2: TokenBatch(id="broken", seq=2, index=4, token_ids=(5,), text="e",
                             timings={"first_token": t + 30 * ms, "emitted": t + 31 * ms}),
               3: TokenBatch(id="broken", seq=3, index=5, finish="error", error="generation failed: boom",
                             error_code="internal_error", timings={"emitted": t + 40 * ms})}
    record = build(StreamMeta("broken", "team-a", "tiny-random", t), batches)
    path = tmp_path / "broken.json"
    path.write_text(record.model_dump_json())
    page = tab.page
    await page.select_option("#mode", "instant")
    await page.set_input_files("#import", str(path))
    await page.wait_for_function("() => document.body.dataset.replay === 'done'")
    assert await page.text_content("#d-id") == "broken"
    assert await page.text_content("#text") == "abe"
    assert await page.locator("#timeline .batch-mark").count() == 3
    assert await page.locator("#timeline .batch-mark.error").count() == 1
    assert await page.locator("#timeline .gap-missing").count() == 1
    notes = await page.locator("#notes .note").all_text_contents()
    assert notes == ["gap: batches 1..1 are missing", "error (internal_error): generation failed: boom"]
    assert await page.text_content("#s-finish") == "error"
    assert await page.text_content("#d-request") == "(the request was not kept)"
    assert tab.errors == []
