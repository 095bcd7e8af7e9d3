"""Hostile input: at least 500 malformed requests, no 5xx, and the relay still serves afterwards.

Hypothesis generates the requests (with a fixed seed, so a failure reproduces); they are then
sent to a real relay over HTTP. Sampled values stay small (max_tokens capped at 8) so valid
requests that slip through cost the tiny generator little.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from generator.service.worker import GeneratorWorker
from tokenpipe.settings import Settings

from .conftest import start_relay

FIELDS = ["model", "prompt", "messages", "input_ids", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "stop", "seed", "stream", "stream_options", "n", "coalesce", "ignore_eos", "user", "logprobs",
          "presence_penalty", "tools", "response_format"]
PATHS = ["/v1/streams", "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/streams/x",
         "/v1/streams/../../etc/passwd", "/v1/streams/%00", "/v1/streams/" + "a" * 300, "/v1/streams/tp.tok.>", "/",
         "/readyz", "/v1/nope", "/v1/streams/x?replay=true&speed=1e-320", "/v1/streams/x?last_event_id=" + "9" * 5000,
         "/metrics", "/openapi.json"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
                    st.sampled_from(["tiny-random", "user", "assistant", "system", "", "\x00", "💥" * 5, "a.b.>"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard", 5]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10),
                         st.one_of(json_values, messages, st.integers(0, 8)), max_size=6)
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b'{"prompt": "x", "max_tokens": 1e999}'),
    st.just(b'{"prompt": NaN}'),
    st.just(b"\xff\xfe\x00{"),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    # issue 15: each was a 500 (plain text) on every create route
    st.just(b'{"prompt": "\\ud800"}'),
    st.just(b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    st.just(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    st.just(b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    st.just(b'{"prompt": "x", "temperature": 5e-324, "top_p": 5e-324, "max_tokens": 2}'),
)


@st.composite
def hostile_request(draw: st.DrawFn) -> dict[str, Any]:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "DELETE", "PUT", "PATCH"]))
    path = draw(st.sampled_from(PATHS))
    headers = draw(st.dictionaries(st.sampled_from(["content-type", "last-event-id", "authorization", "accept"]),
                                   st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
                                   max_size=2))
    content = json.dumps(draw(bodies)).encode() if draw(st.booleans()) else draw(raw_bodies)
    return {"method": method, "url": path, "headers": headers, "content": content}


def generate(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    @seed(20261129)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(hostile_request())
    def collect(req: dict[str, Any]) -> None:
        out.append(req)

    collect()
    return out


async def test_hostile_requests_never_5xx_and_relay_keeps_serving(settings: Settings,
                                                                 generator: GeneratorWorker) -> None:
    cases = generate(600)
    assert len(cases) >= 500
    relay = await start_relay(settings.replace(max_tokens_cap=8, max_body_bytes=64 * 1024))
    statuses: dict[int, int] = {}
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            for case in cases:
                async with http.stream(**case) as resp:
                    await resp.aread()  # SSE responses of valid requests end with done/error
                statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (case, resp.status_code, resp.text[:300])
            r = await http.post("/v1/chat/completions", json={"model": "tiny-random", "max_tokens": 4,
                                                              "messages": [{"role": "user", "content": "ok?"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        await relay.stop()
    assert sum(statuses.values()) >= 500
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 400  # mostly rejected, as hostile input should be
