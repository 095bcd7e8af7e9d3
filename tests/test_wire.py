"""The wire contract as pure functions."""

from __future__ import annotations

import msgpack
import pytest

from tokenpipe.errors import InvalidRequest, WireFormatError
from tokenpipe.subjects import cancel_subject, request_subject, token_subject
from tokenpipe.wire import WIRE_VERSION, Request, SamplingParams, TokenBatch, Usage


def test_request_roundtrip_keeps_every_field() -> None:
    req = Request.create("smollm2-135m", messages=({"role": "user", "content": "héllo 👋"},),
                         params=SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, stop=("\n",),
                                               seed=3),
                         tenant="acme")
    again = Request.decode(req.encode())
    assert again == req
    assert len(req.id) >= 22 and "." not in req.id


def test_batch_roundtrip_and_json() -> None:
    b = TokenBatch(id="abc", seq=3, index=10, token_ids=(1, 2), text="hi", finish="stop", usage=Usage(5, 12),
                   timings={"emitted": 1})
    assert TokenBatch.decode(b.encode()) == b
    assert b.to_json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_unknown_keys_are_ignored() -> None:
    raw = msgpack.packb({"v": WIRE_VERSION, "id": "x", "seq": 0, "index": 0, "token_ids": [5], "text": "a",
                         "shiny_new_field": {"nested": True}})
    assert TokenBatch.decode(raw).token_ids == (5,)
    req = msgpack.packb({"v": 1, "id": "r", "model": "m", "prompt": "p", "future": 1})
    assert Request.decode(req).prompt == "p"


@pytest.mark.parametrize("data", [b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb({"id": "no-version"}),
                                  msgpack.packb({"v": WIRE_VERSION + 1, "id": "x"})])
def test_undecodable_bytes_raise_wire_format_error(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        Request.decode(data)
    with pytest.raises(WireFormatError):
        TokenBatch.decode(data)


@pytest.mark.parametrize("params, param", [
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 20}, "stop"),
    ({"seed": float("nan")}, "seed"),
])
def test_invalid_sampling_params_name_the_param(params: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_map(params)
    assert info.value.param == param


@pytest.mark.parametrize("obj", [
    {"id": "r", "model": "m"},  # no prompt at all
    {"id": "r", "model": "m", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
    {"id": "r", "model": "m", "messages": []},
    {"id": "r", "model": "m", "messages": [{"role": "wizard", "content": "b"}]},
    {"id": "r", "model": "m", "input_ids": [1, -2]},
    {"id": "r", "model": "m", "input_ids": "abc"},
    {"id": 5, "model": "m", "prompt": "a"},
])
def test_invalid_requests_are_rejected(obj: dict) -> None:
    with pytest.raises(InvalidRequest):
        Request.from_map({"v": 1, **obj})


def test_subjects_refuse_dots_and_wildcards() -> None:
    assert request_subject("smollm2-135m") == "tp.req.smollm2-135m"
    assert token_subject("abc_D-1") == "tp.tok.abc_D-1"
    for bad in ("a.b", "a*", ">", "a b", ""):
        with pytest.raises(InvalidRequest):
            token_subject(bad)
        with pytest.raises(InvalidRequest):
            cancel_subject(bad)
