"""The relay's chat page (relay/static/index.html) in a real headless Chromium, against the real pipeline.

Needs Debian's chromium at /usr/bin/chromium (Playwright's pip wheel brings only the driver; no browser is
downloaded). Without it these tests skip, unless TOKENPIPE_REQUIRE_BROWSER=1 (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from generator.service.worker import GeneratorWorker

from .conftest import RelayServer, engine_held_after, read_sse, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path("/tmp/tokenpipe-page.png")
PROMPT = "Tell me a very long story about message queues."
TIMEOUT_MS = 30_000


def _unavailable(reason: str) -> None:
    if os.environ.get("TOKENPIPE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (and TOKENPIPE_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(reason)


@dataclass
class Tab:
    """A page with the console errors and uncaught exceptions it reported."""

    page: Any
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"no browser at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[dev]')")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        await b.close()


@pytest.fixture
async def tab(browser: Any, relay: RelayServer) -> AsyncIterator[Tab]:
    """A fresh page (so a fresh chat history) on the relay's ``/``."""
    context = await browser.new_context(viewport={"width": 1100, "height": 760})
    page = await context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    t = Tab(page)
    page.on("console", lambda msg: t.errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: t.errors.append(f"pageerror: {exc}"))
    resp = await page.goto(relay.url + "/")
    assert resp is not None and resp.status == 200
    yield t
    await context.close()


async def wait_idle(tab: Tab) -> None:
    """Until the page has a stream id and is no longer busy: the stream's done (or error) arrived."""
    try:
        await tab.page.wait_for_function(
            """() => {
                const $ = (id) => document.getElementById(id);
                return $("sid").textContent !== "–" && !$("send").disabled && $("stop").disabled;
            }""",
            timeout=TIMEOUT_MS,
        )
    except Exception as exc:
        log = await tab.page.locator("#log").inner_text()
        raise AssertionError(f"page did not finish the stream: {exc}\nlog: {log!r}\nerrors: {tab.errors}") from exc


async def answer_text(tab: Tab) -> str:
    """The (only) assistant bubble's answer: its text nodes, without the ``[finish]`` note element."""
    assert await tab.page.locator(".msg.assistant").count() == 1
    return str(await tab.page.locator(".msg.assistant").evaluate(
        "el => Array.from(el.childNodes).filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.data).join('')"))


async def replay(http: httpx.AsyncClient, stream_id: str) -> tuple[list[dict], dict]:
    """The stream's ``tokens`` events and its ``done`` event, read back over HTTP."""
    async with http.stream("GET", f"/v1/streams/{stream_id}") as resp:
        assert resp.status_code == 200
        events = [(e, json.loads(d)) for e, _, d in await read_sse(resp)]
    kinds = [e for e, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"tokens"}, kinds
    return [d for e, d in events if e == "tokens"], events[-1][1]


async def start_chat(tab: Tab, *, max_tokens: int, temperature: float) -> tuple[dict, str]:
    """Set the controls, type the prompt and press Enter; returns the POST body the page sent and the new id."""
    page = tab.page
    await page.fill("#max_tokens", str(max_tokens))
    await page.fill("#temperature", str(temperature))
    await page.fill("#prompt", PROMPT)
    async with page.expect_response(lambda r: r.url.endswith("/v1/streams") and r.request.method == "POST") as info:
        await page.press("#prompt", "Enter")
    created = await info.value
    assert created.status == 201, await created.text()
    return created.request.post_data_json, (await created.json())["id"]


async def test_page_loads_without_errors(tab: Tab) -> None:
    page = tab.page
    assert await page.title() == "tokenpipe"
    # The header lists the served models (fetched from /v1/models once the page has loaded).
    await page.wait_for_function("() => document.getElementById('model').textContent.includes('tiny-random')")
    assert await page.is_enabled("#send") and await page.is_disabled("#stop")
    assert await page.input_value("#max_tokens") == "256"
    for stat in ("ttft", "tps", "ntok", "nbatch", "sid"):
        assert await page.text_content(f"#{stat}") == "–"
    # Shift+Enter is a newline, not a send.
    await page.click("#prompt")
    await page.keyboard.type("a")
    await page.keyboard.press("Shift+Enter")
    await page.keyboard.type("b")
    assert await page.input_value("#prompt") == "a\nb"
    assert await page.locator(".msg").count() == 0
    assert tab.errors == []


async def test_chat_streams_answer_and_stats(tab: Tab, http: httpx.AsyncClient) -> None:
    page = tab.page
    # Sampled: tiny-random's greedy answer is all newlines (fine, but not much to look at).
    sent, sid = await start_chat(tab, max_tokens=24, temperature=0.7)
    assert sent["max_tokens"] == 24 and sent["temperature"] == 0.7
    assert sent["messages"] == [{"role": "user", "content": PROMPT}]
    assert await page.locator(".msg.user").inner_text() == PROMPT
    assert await page.input_value("#prompt") == ""
    await wait_idle(tab)

    assert await page.text_content("#sid") == sid
    assert re.fullmatch(r"\d+ ms", await page.text_content("#ttft") or ""), await page.text_content("#ttft")
    tokens, done = await replay(http, sid)
    usage = done["usage"]
    assert 1 <= usage["completion_tokens"] <= 24
    assert int(await page.text_content("#ntok") or "") == usage["completion_tokens"]
    assert usage["completion_tokens"] == sum(len(t["token_ids"]) for t in tokens)
    assert int(await page.text_content("#nbatch") or "") == len(tokens)
    answer = await answer_text(tab)
    assert answer == "".join(t["text"] for t in tokens)
    # A finish other than "stop" is noted after the answer.
    note = "" if done["finish"] == "stop" else f"[{done['finish']}]"
    assert (await page.locator(".msg.assistant").inner_text()).strip().endswith(note)
    await page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert tab.errors == []


async def test_stop_button_cancels_generation(tab: Tab, http: httpx.AsyncClient, generator: GeneratorWorker,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    page = tab.page
    # Held after 100 tokens until the page's DELETE is answered: the stream cannot end between the check that
    # Stop is enabled and the click, however fast the machine (its WebSocket twin lost that race in a CI run).
    with engine_held_after(generator, 100, monkeypatch) as release:
        # Greedy: tiny-random then repeats a newline and does not reach EOS within 2000 tokens.
        _, sid = await start_chat(tab, max_tokens=2000, temperature=0)
        # A long generation is under way and drawn into the page ...
        await page.wait_for_function("() => Number(document.getElementById('nbatch').textContent) > 2")
        await page.wait_for_function("() => document.querySelector('.msg.assistant').textContent.length > 0")
        assert await page.is_enabled("#stop"), "the generation finished before Stop could be clicked"
        # ... until Stop.
        async with page.expect_response(lambda r: r.request.method == "DELETE") as info:
            await page.click("#stop")
        deleted = await info.value
        release.set()
    assert deleted.url.endswith(f"/v1/streams/{sid}")
    assert deleted.status == 200
    await wait_idle(tab)

    tokens, done = await replay(http, sid)
    assert done["finish"] == "cancelled"
    ntok = done["usage"]["completion_tokens"]
    assert 0 < ntok < 2000
    assert int(await page.text_content("#ntok") or "") == ntok == sum(len(t["token_ids"]) for t in tokens)
    assert await answer_text(tab) == "".join(t["text"] for t in tokens)
    assert (await page.locator(".msg.assistant small").text_content() or "").strip() == "[cancelled]"
    assert float(await page.text_content("#tps") or "") > 0
    # The engine let go of the sequence.
    await wait_until(lambda: all(r.id != sid for r in generator.runner.engine.rows), 10, "the cancelled row to leave")
    assert tab.errors == []


async def test_regression_stop_moved_under_the_pointer_while_the_answer_was_drawn(tab: Tab) -> None:
    """CI runs clicked an enabled Stop and no cancel went out: the answer, drawn a few characters a frame,
    pushed the form down between the press and the release, so the click landed on neither. The input bar now
    stays where it is however far the answer grows (the conversation scrolls in its own box)."""
    page = tab.page
    await page.evaluate("""() => {
        window.stopAt = new Set();
        const look = () => {
            const r = document.getElementById("stop").getBoundingClientRect();
            window.stopAt.add(r.left + "," + r.top + "," + r.width + "," + r.height);
            const answer = document.querySelector(".msg.assistant");
            if (answer) window.answerHeight = answer.getBoundingClientRect().height;
            requestAnimationFrame(look);
        };
        requestAnimationFrame(look);
    }""")
    await start_chat(tab, max_tokens=200, temperature=0)  # greedy tiny-random: a newline a token
    await wait_idle(tab)
    stop_at, height, window = await page.evaluate(
        "() => [Array.from(window.stopAt), window.answerHeight, window.innerHeight]")
    assert height > window, "the answer did not outgrow the window: the test shows nothing"
    assert len(stop_at) == 1, f"Stop moved while the answer was drawn: {stop_at}"
    # The end of the answer is in sight: the conversation followed it.
    below = "() => { const l = document.getElementById('log'); return l.scrollHeight - l.scrollTop - l.clientHeight; }"
    assert await page.evaluate(below) < 24
    assert tab.errors == []


async def test_no_stop_or_second_send_while_the_stream_is_created(tab: Tab) -> None:
    """Stop DELETEs ``streamId``: while the next POST is pending, that is still the previous (finished) stream."""
    page = tab.page
    await start_chat(tab, max_tokens=4, temperature=0.7)
    await wait_idle(tab)
    release = asyncio.Event()
    held = asyncio.Event()

    async def hold(route: Any) -> None:
        held.set()
        await release.wait()
        await route.continue_()

    await page.route("**/v1/streams", hold)
    await page.fill("#prompt", "And another one.")
    await page.press("#prompt", "Enter")
    await asyncio.wait_for(held.wait(), TIMEOUT_MS / 1000)
    assert await page.is_disabled("#send")
    assert await page.is_disabled("#stop"), "Stop is enabled before the new stream exists"
    # Enter does not send a second request meanwhile either.
    await page.fill("#prompt", "A third one.")
    await page.press("#prompt", "Enter")
    assert await page.locator(".msg.user").count() == 2
    assert await page.input_value("#prompt") == "A third one."
    release.set()
    await page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2")
    await wait_idle(tab)
    assert tab.errors == []


async def test_stream_error_event_shows_the_message_once(tab: Tab) -> None:
    """An ``error`` event (a failed generation) turns the bubble into the partial answer plus the message."""
    page = tab.page
    body = ('id: 0\nevent: tokens\ndata: {"seq":0,"index":0,"token_ids":[1,2],"text":"partial answer","timings":{}}\n\n'
            'id: 1\nevent: error\ndata: {"message":"generation failed: boom","finish":"error","usage":null}\n\n')

    async def fake_stream(route: Any) -> None:
        if route.request.method == "GET":
            await route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)
        else:
            await route.fallback()

    await page.route("**/v1/streams/*", fake_stream)
    await start_chat(tab, max_tokens=4, temperature=0.7)
    await wait_idle(tab)
    bubble = page.locator(".msg.error")
    assert await bubble.count() == 1
    text = await bubble.evaluate(
        "el => Array.from(el.childNodes).filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.data).join('')")
    assert text == "partial answer\ngeneration failed: boom"


async def test_page_with_api_keys_asks_for_a_key_then_chats(browser: Any, settings: Any,
                                                            generator: GeneratorWorker) -> None:
    from .conftest import start_relay

    keyed = await start_relay(settings.replace(api_keys="page-key:pat"),
                              ready_headers={"Authorization": "Bearer page-key"})
    context = await browser.new_context()
    try:
        page = await context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(keyed.url + "/")
        await page.wait_for_function("() => document.getElementById('model').textContent === 'API key required'")
        assert await page.is_visible("#apikey")
        await page.fill("#apikey", "page-key")
        await page.dispatch_event("#apikey", "change")
        await page.wait_for_function("() => document.getElementById('model').textContent === 'tiny-random'")
        await page.fill("#max_tokens", "6")
        await page.fill("#temperature", "0")  # greedy tiny-random never ends early (no EOS)
        await page.fill("#prompt", "hello with a key")
        await page.press("#prompt", "Enter")
        await page.wait_for_function("() => document.getElementById('ntok').textContent === '6'"
                                     " || document.querySelector('.msg.error') !== null")
        assert await page.locator(".msg.error").count() == 0
        assert errors == []
    finally:
        await context.close()
        await keyed.stop()
