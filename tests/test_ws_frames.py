"""``/v1/ws`` frames, property-tested: any frame a client can send gets a reply or an error frame,
never a crash, a closed socket or a hang (hypothesis, a real ``websockets`` client, the real relay)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection, connect

from .conftest import start_relay

REPLIES = {"created", "attached", "cancelled", "authenticated", "pong", "error"}
STREAM_FRAMES = {"tokens", "gap", "done"}
REPLY_TIMEOUT_S = 30.0

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
stream_ids = st.sampled_from(["0" * 26, "../x", "", "a" * 200]) | st.text(max_size=30)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "ref": st.none() | st.integers() | st.text(max_size=300) | json_values,
    "id": stream_ids | json_values,
    "after_seq": st.integers(min_value=-3, max_value=10**19) | json_values,
    "replay": st.booleans() | json_values,
    "speed": st.sampled_from([0, 0.01, 1, 1000, 1e9, -1]) | json_values,
    "cancel_on_disconnect": st.booleans() | json_values,
    "api_key": st.text(max_size=20) | json_values,
    "prompt": st.text(max_size=40) | json_values,
    "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
    "input_ids": st.lists(st.integers(min_value=-2, max_value=300), max_size=5) | json_values,
    "model": st.sampled_from(["tiny-random", "nope", ""]) | json_values,
    "temperature": st.floats(allow_nan=False) | json_values,
    "coalesce": st.just({"max_tokens": 1}) | json_values,
    "bogus": json_values,
}
# A create always says max_tokens, and a small one: a generated frame must not start long generations.
small_max_tokens = st.sampled_from([-1, 0, 1, 3, 8, "3", 2.5, True])
typed_frames = st.builds(
    lambda kind, fields, max_tokens: {"type": kind, **fields,
                                      **({"max_tokens": max_tokens} if kind == "create" else {})},
    st.sampled_from(["auth", "create", "attach", "cancel", "ping", "pong", "nope", ""]) | st.text(max_size=10),
    st.fixed_dictionaries({}, optional=FIELDS),
    small_max_tokens,
)
frames = (typed_frames.map(json.dumps)
          | json_values.map(json.dumps)
          | st.text(max_size=60)
          | st.binary(max_size=60))


def exchange(ws: ClientConnection, frame: str | bytes, marker: str) -> list[dict[str, Any]]:
    """Send ``frame`` and a ping with ref ``marker``; the reply frames (not stream frames) that
    came before that pong."""
    ws.send(frame)
    ws.send(json.dumps({"type": "ping", "ref": marker}))
    replies = []
    while True:
        got = json.loads(ws.recv(timeout=REPLY_TIMEOUT_S))
        assert isinstance(got, dict) and isinstance(got.get("type"), str), got
        if got == {"type": "pong", "ref": marker}:
            return replies
        if got["type"] in STREAM_FRAMES or (got["type"] == "error" and "seq" in got):
            continue  # a stream's own events, from a create or attach earlier
        assert got["type"] in REPLIES, got
        if got["type"] == "error":
            assert isinstance(got["code"], str) and got["message"] and 400 <= got["status"] < 600, got
        replies.append(got)


async def test_any_frame_gets_a_reply_or_an_error_frame(settings: Any, generator: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    # No keepalive pings on this long-lived socket, from either end: both websockets' client
    # and uvicorn draw a ping's payload from the global `random`, and a ping that fell within a
    # draw made Hypothesis warn "Do not use the `random` module inside strategies" (in full
    # suite runs, where the test outlasted the 15-20 s ping interval).
    quiet = await start_relay(settings.replace(keepalive_s=3600.0))
    url = quiet.url.replace("http://", "ws://") + "/v1/ws"
    markers = (f"marker-{i}" for i in itertools.count())

    def run() -> None:
        with connect(url, max_size=None, ping_interval=None) as ws:
            @settings_(max_examples=200, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
            @given(frame=frames)
            def one(frame: str | bytes) -> None:
                replies = exchange(ws, frame, next(markers))
                assert len(replies) == 1, (frame, replies)  # exactly one answer per frame

            one()

    try:
        with caplog.at_level(logging.ERROR):
            await asyncio.to_thread(run)  # the relay serves on this test's event loop meanwhile
    finally:
        await quiet.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_before_auth_any_frame_is_refused_with_one_error_frame(settings: Any, generator: Any) -> None:
    keyed = await start_relay(settings.replace(api_keys="frame-key:fran"),
                              ready_headers={"Authorization": "Bearer frame-key"})
    url = keyed.url.replace("http://", "ws://") + "/v1/ws"

    def run() -> None:
        @settings_(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(frame=frames)
        def one(frame: str | bytes) -> None:
            with connect(url) as ws:
                ws.send(frame)
                reply = json.loads(ws.recv(timeout=REPLY_TIMEOUT_S))
                assert reply["type"] == "error" and reply["code"] in ("invalid_api_key", "invalid_request"), reply
                # Nothing else came, and the socket still takes the key.
                ws.send(json.dumps({"type": "auth", "api_key": "frame-key"}))
                assert json.loads(ws.recv(timeout=REPLY_TIMEOUT_S))["type"] == "authenticated"

        one()

    try:
        await asyncio.to_thread(run)
    finally:
        await keyed.stop()
