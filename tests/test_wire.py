"""The wire contract as pure functions."""

from __future__ import annotations

import json

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tokenpipe.errors import InvalidRequest, WireFormatError
from tokenpipe.subjects import cancel_subject, owner_of_request, parse_cancel_subject, request_subject, token_subject
from tokenpipe.telemetry import producer_span
from tokenpipe.wire import (
    WIRE_VERSION,
    Announcement,
    Request,
    SamplingParams,
    StreamMeta,
    TokenBatch,
    Usage,
    new_request_id,
    peek_request_id,
)


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
    assert request_subject("smollm2-135m", "relay") == "tp.req.smollm2-135m.relay"
    assert token_subject("relay", "abc_D-1") == "tp.tok.relay.abc_D-1"
    assert cancel_subject("app1", "abc") == "tp.cancel.app1.abc"
    for bad in ("a.b", "a*", ">", "a b", ""):
        with pytest.raises(InvalidRequest):
            token_subject("relay", bad)
        with pytest.raises(InvalidRequest):
            cancel_subject("relay", bad)
        with pytest.raises(InvalidRequest):
            token_subject(bad, "abc")  # the owner is a subject token too
        with pytest.raises(InvalidRequest):
            request_subject("m", bad)


def test_the_owner_is_read_from_request_and_cancel_subjects() -> None:
    assert owner_of_request("tp.req.m.alice") == "alice"
    assert parse_cancel_subject("tp.cancel.alice.s1") == ("alice", "s1")
    for bad in ("tp.req.m", "tp.req.m.a.b", "tp.tok.m.a"):
        with pytest.raises(InvalidRequest):
            owner_of_request(bad)


def test_build_validates_untrusted_values_and_stamps_id_and_time() -> None:
    req = Request.build("m", messages=[{"role": "developer", "content": "x"}], params={"max_tokens": 3, "stop": "\n"},
                        coalesce={"max_tokens": 0}, tenant="acme")
    assert req.messages == ({"role": "system", "content": "x"},) and req.params.stop == ("\n",)
    assert req.coalesce.max_tokens == 0 and req.tenant == "acme" and req.created_at > 0
    assert Request.decode(req.encode()) == req
    assert Request.build("m", prompt="p", request_id="mine").id == "mine"
    assert Request.build("m", messages=(m for m in [{"role": "user", "content": "x"}])).messages
    assert Request.build("m", input_ids=iter([1, 2])).input_ids == (1, 2)
    with pytest.raises(InvalidRequest) as info:
        Request.build("m", prompt="p", params={"temperature": 9})
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequest) as info:
        Request.build("m", messages="not a list")
    assert info.value.param == "messages"


@pytest.mark.parametrize("data, expected", [
    (msgpack.packb({"id": "abc_1", "model": 5}), "abc_1"),  # undecodable as a Request, id still usable
    (msgpack.packb({"id": "a.b"}), None),  # not a stream id: no stream to tell
    (msgpack.packb({"id": 7}), None),
    (msgpack.packb([1, 2]), None),
    (b"\xc1", None),
    (b"", None),
])
def test_peek_request_id_finds_only_usable_ids(data: bytes, expected: str | None) -> None:
    assert peek_request_id(data) == expected


def test_error_batch_ends_the_stream_after_what_was_published() -> None:
    first = TokenBatch.error_for("s", "bad", "invalid_request")
    assert (first.seq, first.index, first.finish, first.error, first.error_code) == (0, 0, "error", "bad",
                                                                                      "invalid_request")
    assert first.usage == Usage(0, 0) and first.timings["emitted"] > 0 and first.is_final
    later = TokenBatch.error_for("s", "died", "generation_error", seq=3, index=17)
    assert (later.seq, later.index, later.usage) == (3, 17, Usage(0, 17))
    assert TokenBatch.decode(later.encode()) == later


def test_stream_meta_roundtrip_and_entries_written_before_versioning() -> None:
    meta = StreamMeta("abc", "acme", "m", 123)
    assert StreamMeta.decode(meta.encode()) == meta
    assert json.loads(meta.encode())["v"] == WIRE_VERSION
    old = json.dumps({"id": "abc", "tenant": "acme", "model": "m", "created_at": 123}).encode()
    assert StreamMeta.decode(old) == meta
    assert StreamMeta.decode(json.dumps({**json.loads(old), "later": [1]}).encode()) == meta


def test_announcement_roundtrip_defaults_and_unknown_keys() -> None:
    ann = Announcement(worker="w", model="m", ready=False, max_batch=32, running=2, active=3, pid=9,
                       streams=("a", "b"), device="cpu", ttl_s=1.5, ts=2.0)
    assert Announcement.decode(ann.encode()) == ann
    sparse = Announcement.decode(b'{"worker": "w1", "model": "m", "ttl_s": 1.0, "shiny": true}')
    assert sparse == Announcement(worker="w1", model="m", ttl_s=1.0) and sparse.ready


@pytest.mark.parametrize("data", [b"", b"{", b"[1]", b'{"model": "m"}', b'{"worker": "w", "model": "m", "ttl_s": "x"}',
                                  b'{"v": 99, "worker": "w", "model": "m"}', b'{"v": "1", "worker": "w", "model": "m"}',
                                  b"\xff"])
def test_malformed_control_messages_raise_wire_format_error(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        Announcement.decode(data)
    with pytest.raises(WireFormatError):
        StreamMeta.decode(data)


def test_producer_span_carries_messaging_attributes_and_its_own_context() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with producer_span(provider.get_tracer("t"), "tp.req.m", {"tokenpipe.stream.id": "s"}) as headers:
        pass
    (span,) = exporter.get_finished_spans()
    assert span.kind == SpanKind.PRODUCER and span.name == "publish tp.req.m"
    assert dict(span.attributes or {}) == {"messaging.system": "nats", "messaging.operation.type": "publish",
                                           "messaging.destination.name": "tp.req.m", "tokenpipe.stream.id": "s"}
    assert headers["traceparent"].split("-")[2] == format(span.context.span_id, "016x")


def test_stream_id_starting_with_a_dash_read_as_a_cli_option() -> None:
    """`tokenpipe replay <id>` took an id beginning with '-' for an option (1 id in 64): new ids never do."""
    ids = [new_request_id() for _ in range(5000)]
    assert not [i for i in ids if i.startswith("-")]
    assert len(set(ids)) == len(ids) and all(len(i) == 22 for i in ids)
