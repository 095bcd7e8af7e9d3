"""The HTTP protocol's typed models (relay/protocol.py) and the edge defects they fixed."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from relay.protocol import Bodies
from tokenpipe.errors import InvalidRequest
from tokenpipe.settings import Settings
from tokenpipe.wire import Request, SamplingParams

from .conftest import read_sse


def test_a_native_body_becomes_the_wire_request_the_wire_would_decode(settings: Settings) -> None:
    """What the WebSocket route calls: parsed JSON in, the wire request out, no second validation."""
    bodies = Bodies(settings.replace(max_tokens_cap=64))
    body = bodies.parse_native({"messages": [{"role": "developer", "content": "be brief", "name": "x"}],
                                  "max_tokens": 8.0, "top_k": -1, "stop": "\n", "coalesce": {"max_tokens": 0}})
    req = body.to_request("tiny-random", "acme")
    assert req.messages == ({"role": "system", "content": "be brief"},)
    assert req.params == SamplingParams(max_tokens=8, top_k=0, stop=("\n",))
    assert req.coalesce.max_tokens == 0 and req.tenant == "acme"
    assert Request.decode(req.encode()) == req  # the generator reads the same request
    assert bodies.parse_native({"prompt": "x"}).to_request("m", "t").params.max_tokens == 64  # default under the cap
    for bad, param in (({"prompt": "x", "max_tokens": 65}, "max_tokens"), ({"prompt": "x", "seed": "7"}, "seed"),
                       ({"prompt": "x", "temprature": 1}, "temprature"), ({"prompt": "x", "stop": [""]}, "stop"),
                       ({"prompt": "x", "coalesce": {"max_delay_ms": -1}}, "coalesce"), ({}, None)):
        with pytest.raises(InvalidRequest) as info:
            bodies.parse_native(bad)
        assert info.value.param == param, bad


def test_every_sampling_field_is_in_every_body_and_the_document_with_its_bounds(settings: Settings) -> None:
    bodies = Bodies(settings.replace(max_tokens_cap=64))
    for model in (bodies.native, bodies.chat, bodies.completion):
        schema = model.model_json_schema()["properties"]
        for field in dataclasses.fields(SamplingParams):
            assert field.name in schema, (model.__name__, field.name)
        assert schema["max_tokens"]["anyOf"][0]["maximum"] == 64
        assert schema["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}


async def test_regression_last_event_id_3_0_was_accepted_in_the_query_but_a_400_in_the_header(
        http: httpx.AsyncClient) -> None:
    sid = (await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})).json()["id"]
    for bad in ("3.0", "1e0", "2.", "+1"):
        query = await http.get(f"/v1/streams/{sid}", params={"last_event_id": bad})
        header = await http.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": bad})
        assert query.status_code == header.status_code == 400, (bad, query.text, header.text)
        assert query.json()["error"]["param"] == "last_event_id" and header.json()["error"]["param"] == "Last-Event-ID"
    async with http.stream("GET", f"/v1/streams/{sid}", params={"last_event_id": "0"}) as a:
        by_query = await read_sse(a)
    async with http.stream("GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": "0"}) as b:
        by_header = await read_sse(b)
    assert by_query == by_header and by_query[-1][0] == "done"
    assert all(json.loads(data)["seq"] > 0 for event, _, data in by_query if event == "tokens")


async def test_regression_speed_1e_400_underflowed_to_0_and_replayed_as_fast_as_possible(
        http: httpx.AsyncClient) -> None:
    sid = (await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})).json()["id"]
    for bad in ("1e-400", "-1e-400", "0.009999999999999999999999"):
        r = await http.get(f"/v1/streams/{sid}", params={"replay": "true", "speed": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speed", (bad, r.text)
    for zero in ("0", "0.0", "0e-999"):  # a zero written as a zero is "as fast as possible"
        async with http.stream("GET", f"/v1/streams/{sid}", params={"replay": "true", "speed": zero}) as resp:
            assert resp.status_code == 200
            assert (await read_sse(resp))[-1][0] == "done"


@pytest.mark.parametrize("body, param", [({"prompt": ""}, "prompt"), ({"input_ids": []}, "input_ids")])
async def test_regression_an_empty_native_prompt_was_a_201_then_an_error_event(http: httpx.AsyncClient, body: dict,
                                                                               param: str) -> None:
    r = await http.post("/v1/streams", json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


async def test_a_body_that_is_not_json_by_its_content_type_is_a_400(http: httpx.AsyncClient) -> None:
    """What a page on another site can send to a relay on loopback without CORS' consent is refused."""
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        r = await http.post("/v1/streams", content=body, headers={"content-type": kind} if kind else {})
        assert r.status_code == 400 and r.json()["error"]["param"] == "content-type", (kind, r.text)
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json", "Application/JSON"):
        r = await http.post("/v1/streams", content=body, headers={"content-type": kind})
        assert r.status_code == 201, (kind, r.text)
        await http.delete(f"/v1/streams/{r.json()['id']}")
