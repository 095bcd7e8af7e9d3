"""The chat page's WebSocket toggle in a real headless Chromium: the same chat over ``/v1/ws``
(one socket, create and cancel frames, a first auth frame when keys are on)."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest

from generator.service.worker import GeneratorWorker

from .conftest import engine_held_after, wait_until
from .test_browser import (  # noqa: F401  (fixtures, used by name)
    PROMPT,
    TIMEOUT_MS,
    Tab,
    answer_text,
    browser,
    replay,
    tab,
    wait_idle,
)


class Sockets:
    """Every WebSocket the page opens, with the frames it sent and received (JSON).

    Playwright reports frames as events from the browser's network side, which may come after
    what the page shows (a CI run found the page idle after its Stop and no cancel frame in
    ``sent`` yet): :meth:`sent_types` waits until the frames expected are in."""

    def __init__(self, page: Any) -> None:
        self.urls: list[str] = []
        self.sent: list[dict] = []
        self.received: list[dict] = []
        self.posts: list[str] = []
        page.on("websocket", self._opened)
        page.on("request", lambda r: self.posts.append(r.url) if r.method in ("POST", "DELETE") else None)

    def _opened(self, ws: Any) -> None:
        import json

        self.urls.append(ws.url)
        ws.on("framesent", lambda payload: self.sent.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: self.received.append(json.loads(payload)))

    async def sent_types(self, expected: list[str]) -> list[str]:
        """The types of the frames sent, once ``expected`` have all been reported (or after 10 s)."""
        with contextlib.suppress(AssertionError):  # timed out: the caller's comparison shows what came
            await wait_until(lambda: len(self.sent) >= len(expected), timeout=10)
        return [f["type"] for f in self.sent]


async def chat_over_ws(page: Any, *, max_tokens: int, temperature: float) -> None:
    await page.select_option("#transport", "ws")
    await page.fill("#max_tokens", str(max_tokens))
    await page.fill("#temperature", str(temperature))
    await page.fill("#prompt", PROMPT)
    await page.press("#prompt", "Enter")


async def test_chat_over_the_websocket_toggle(tab: Tab, http: httpx.AsyncClient) -> None:  # noqa: F811
    page = tab.page
    sockets = Sockets(page)
    await chat_over_ws(page, max_tokens=24, temperature=0.7)
    await wait_idle(tab)
    sid = await page.text_content("#sid")
    assert len(sockets.urls) == 1 and sockets.urls[0].endswith("/v1/ws")
    assert await sockets.sent_types(["create"]) == ["create"]
    create = sockets.sent[0]
    assert create["type"] == "create" and create["max_tokens"] == 24 and create["temperature"] == 0.7
    assert create["messages"] == [{"role": "user", "content": PROMPT}]
    assert not [u for u in sockets.posts if "/v1/streams" in u]  # no HTTP create: the socket did it
    tokens, done = await replay(http, sid or "")
    assert int(await page.text_content("#ntok") or "") == done["usage"]["completion_tokens"]
    assert int(await page.text_content("#nbatch") or "") == len(tokens)
    assert await answer_text(tab) == "".join(t["text"] for t in tokens)
    # A second message goes over the same socket.
    await page.fill("#prompt", "and again")
    await page.press("#prompt", "Enter")
    await page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2")
    await wait_idle(tab)
    assert len(sockets.urls) == 1 and await sockets.sent_types(["create", "create"]) == ["create", "create"]
    assert await page.evaluate("() => localStorage.getItem('tokenpipe.transport')") == "ws"
    assert tab.errors == []


async def test_stop_over_the_websocket_sends_a_cancel_frame(tab: Tab, http: httpx.AsyncClient,  # noqa: F811
                                                            generator: GeneratorWorker,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream is held after 100 tokens until the page has sent its cancel frame (a CI run: tiny-random's
    2,000 tokens ended between the check that Stop was enabled and the click, and no cancel was sent)."""
    page = tab.page
    sockets = Sockets(page)
    with engine_held_after(generator, 100, monkeypatch) as release:
        await chat_over_ws(page, max_tokens=2000, temperature=0)  # greedy tiny-random: no EOS within 2000
        await page.wait_for_function("() => Number(document.getElementById('nbatch').textContent) > 2")
        assert await page.is_enabled("#stop"), "the generation finished before Stop could be clicked"
        await page.click("#stop")
        sent = await sockets.sent_types(["create", "cancel"])
        # What the page and its socket showed, for a failure to say (a busy CI run once saw no cancel frame).
        seen = {"nbatch": await page.text_content("#nbatch"), "stop": await page.is_enabled("#stop"),
                "sockets": len(sockets.urls), "received": [f.get("type") for f in sockets.received][-3:]}
        release.set()
    await wait_idle(tab)
    sid = await page.text_content("#sid")
    assert sent == ["create", "cancel"], seen
    assert sockets.sent[1]["id"] == sid
    assert not [u for u in sockets.posts if "/v1/streams" in u]
    tokens, done = await replay(http, sid or "")
    assert done["finish"] == "cancelled"
    assert int(await page.text_content("#ntok") or "") == done["usage"]["completion_tokens"] < 2000
    assert (await page.locator(".msg.assistant small").text_content() or "").strip() == "[cancelled]"
    assert await answer_text(tab) == "".join(t["text"] for t in tokens)
    assert tab.errors == []


async def test_page_over_websocket_with_api_keys_sends_an_auth_frame_first(
        browser: Any, settings: Any, generator: GeneratorWorker) -> None:  # noqa: F811
    from .conftest import start_relay

    keyed = await start_relay(settings.replace(api_keys="page-key:pat"),
                              ready_headers={"Authorization": "Bearer page-key"})
    context = await browser.new_context()
    try:
        page = await context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        sockets = Sockets(page)
        await page.goto(keyed.url + "/")
        await page.wait_for_function("() => document.getElementById('model').textContent === 'API key required'")
        await page.fill("#apikey", "page-key")
        await page.dispatch_event("#apikey", "change")
        await page.wait_for_function("() => document.getElementById('model').textContent === 'tiny-random'")
        await chat_over_ws(page, max_tokens=6, temperature=0)
        await page.wait_for_function("() => document.getElementById('ntok').textContent === '6'"
                                     " || document.querySelector('.msg.error') !== null")
        assert await page.locator(".msg.error").count() == 0
        assert await sockets.sent_types(["auth", "create"]) == ["auth", "create"]
        assert sockets.sent[0]["api_key"] == "page-key"
        assert sockets.received[0]["type"] == "authenticated"
        assert errors == []
    finally:
        await context.close()
        await keyed.stop()
