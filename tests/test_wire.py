"""The wire contract as pure functions."""

from __future__ import annotations

import json
from typing import Any

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
    SERVICE_TIERS,
    WIRE_VERSION,
    Announcement,
    Cancel,
    CoalesceParams,
    IndexedRequest,
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


def test_service_tier_round_trips_and_a_request_without_one_is_interactive() -> None:
    old = msgpack.packb({"v": 1, "id": "r", "model": "m", "prompt": "p"})  # written before the field
    req = Request.decode(old)
    assert (req.service_tier, req.batch, req.served_tier) == ("auto", False, "default")
    assert "service_tier" not in msgpack.unpackb(req.encode())  # the default: bytes as before the field
    for tier in SERVICE_TIERS:
        given = Request.build("m", prompt="p", service_tier=tier)
        again = Request.decode(given.encode())
        assert again == given and again.service_tier == tier and again.batch == (tier == "flex")
        assert IndexedRequest.decode(IndexedRequest(given, "tp").encode()).request == given
    assert Request.build("m", prompt="p", service_tier=None).service_tier == "auto"  # null: the default
    assert Request.build("m", prompt="p", service_tier="priority").served_tier == "priority"


@pytest.mark.parametrize("tier", ["batch", "FLEX", "", 1, ["flex"]])
def test_an_unknown_service_tier_is_refused_naming_the_accepted_ones(tier: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        Request.build("m", prompt="p", service_tier=tier)
    assert info.value.param == "service_tier"
    assert all(f"'{t}'" in info.value.message for t in SERVICE_TIERS), info.value.message
    with pytest.raises(InvalidRequest):
        Request.decode(msgpack.packb({"v": 1, "id": "r", "model": "m", "prompt": "p", "service_tier": tier}))


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


# -- wire compatibility: bytes as the hand-written codec (before msgspec) wrote them ----------------
_PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, stop=("\n", "END"), seed=3)
_MESSAGES = Request(id="req_messages_1", model="smollm2-135m", messages=(
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 👋"}), params=_PARAMS, tenant="acme",
    created_at=1700000000123456789)
WIRE_VALUES: dict[str, Any] = {
    "request_messages": _MESSAGES,
    "request_prompt": Request(id="req_prompt_2", model="tiny-random", prompt="Once upon a time",
                              coalesce=CoalesceParams(max_tokens=4, max_delay_ms=12.5), created_at=1700000000000000001),
    "request_input_ids": Request(id="req_ids_3", model="tiny-random", input_ids=(1, 2, 300, 70000),
                                 params=SamplingParams(temperature=0.0, ignore_eos=True), created_at=5),
    "batch_first": TokenBatch(id="req_prompt_2", seq=0, index=0, token_ids=(7,), text="Once",
                              timings={"created": 1, "received": 2, "admitted": 3, "first_token": 4, "emitted": 5}),
    "batch_mid": TokenBatch(id="req_prompt_2", seq=3, index=12, token_ids=(101, 102, 103), text=" the cat",
                            timings={"first_token": 1700000000200000000, "emitted": 1700000000200000500}),
    "batch_final_usage": TokenBatch(id="req_prompt_2", seq=4, index=15, finish="length", usage=Usage(4, 15),
                                    timings={"first_token": 9, "emitted": 10}),
    "batch_final_error": TokenBatch(id="req_ids_3", seq=1, index=2, finish="error", error="engine died",
                                    error_code="generation_error", usage=Usage(0, 2), timings={"emitted": 11}),
    "cancel": Cancel("req_prompt_2", "relay-1"),
    "stream_meta": StreamMeta("req_prompt_2", "acme", "tiny-random", 1700000000000000001),
    "announcement": Announcement(worker="gen-1", model="tiny-random", ready=True, max_batch=8, running=2, active=3,
                                 pid=4242, streams=("a", "b"), device="cpu", ttl_s=6.0, ts=1700000000.25,
                                 free_blocks=100, block_size=16),
    "indexed_request": IndexedRequest(_MESSAGES, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
}
# Produced by the hand-written codec (dict → msgpack.packb / json.dumps) at 27e3e53, from WIRE_VALUES.
OLD_BYTES = {
    "request_messages": (
        "8aa17601a26964ae7265715f6d657373616765735f31a56d6f64656cac736d6f6c6c6d322d3133356da670726f6d7074c0a8"
        "6d657373616765739282a4726f6c65a673797374656da7636f6e74656e74a8626520627269656682a4726f6c65a475736572"
        "a7636f6e74656e74ab68c3a96c6c6f20f09f918ba9696e7075745f696473c0a6706172616d7387aa6d61785f746f6b656e73"
        "07ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3feccccccccccccda5746f705f6b28a473746f7092"
        "a10aa3454e44a47365656403aa69676e6f72655f656f73c2a8636f616c6573636582aa6d61785f746f6b656e73c0ac6d6178"
        "5f64656c61795f6d73c0a674656e616e74a461636d65aa637265617465645f6174cf17979cfe3d85cd15"),
    "request_prompt": (
        "8aa17601a26964ac7265715f70726f6d70745f32a56d6f64656cab74696e792d72616e646f6da670726f6d7074b04f6e6365"
        "2075706f6e20612074696d65a86d65737361676573c0a9696e7075745f696473c0a6706172616d7387aa6d61785f746f6b65"
        "6e73cd0100ab74656d7065726174757265cb3ff0000000000000a5746f705f70cb3ff0000000000000a5746f705f6b00a473"
        "746f7090a473656564c0aa69676e6f72655f656f73c2a8636f616c6573636582aa6d61785f746f6b656e7304ac6d61785f64"
        "656c61795f6d73cb4029000000000000a674656e616e74a764656661756c74aa637265617465645f6174cf17979cfe362a00"
        "01"),
    "request_input_ids": (
        "8aa17601a26964a97265715f6964735f33a56d6f64656cab74696e792d72616e646f6da670726f6d7074c0a86d6573736167"
        "6573c0a9696e7075745f696473940102cd012cce00011170a6706172616d7387aa6d61785f746f6b656e73cd0100ab74656d"
        "7065726174757265cb0000000000000000a5746f705f70cb3ff0000000000000a5746f705f6b00a473746f7090a473656564"
        "c0aa69676e6f72655f656f73c3a8636f616c6573636582aa6d61785f746f6b656e73c0ac6d61785f64656c61795f6d73c0a6"
        "74656e616e74a764656661756c74aa637265617465645f617405"),
    "batch_first": (
        "8ba17601a26964ac7265715f70726f6d70745f32a373657100a5696e64657800a9746f6b656e5f6964739107a474657874a4"
        "4f6e6365a666696e697368c0a56572726f72c0a57573616765c0a774696d696e677385a76372656174656401a87265636569"
        "76656402a861646d697474656403ab66697273745f746f6b656e04a7656d697474656405aa6572726f725f636f6465c0"),
    "batch_mid": (
        "8ba17601a26964ac7265715f70726f6d70745f32a373657103a5696e6465780ca9746f6b656e5f69647393656667a4746578"
        "74a82074686520636174a666696e697368c0a56572726f72c0a57573616765c0a774696d696e677382ab66697273745f746f"
        "6b656ecf17979cfe4215c200a7656d6974746564cf17979cfe4215c3f4aa6572726f725f636f6465c0"),
    "batch_final_usage": (
        "8ba17601a26964ac7265715f70726f6d70745f32a373657104a5696e6465780fa9746f6b656e5f69647390a474657874a0a6"
        "66696e697368a66c656e677468a56572726f72c0a5757361676583ad70726f6d70745f746f6b656e7304b1636f6d706c6574"
        "696f6e5f746f6b656e730fac746f74616c5f746f6b656e7313a774696d696e677382ab66697273745f746f6b656e09a7656d"
        "69747465640aaa6572726f725f636f6465c0"),
    "batch_final_error": (
        "8ba17601a26964a97265715f6964735f33a373657101a5696e64657802a9746f6b656e5f69647390a474657874a0a666696e"
        "697368a56572726f72a56572726f72ab656e67696e652064696564a5757361676583ad70726f6d70745f746f6b656e7300b1"
        "636f6d706c6574696f6e5f746f6b656e7302ac746f74616c5f746f6b656e7302a774696d696e677381a7656d69747465640b"
        "aa6572726f725f636f6465b067656e65726174696f6e5f6572726f72"),
    "cancel": (
        "7b2276223a20312c202274797065223a202263616e63656c222c20226964223a20227265715f70726f6d70745f32222c2022"
        "6f776e6572223a202272656c61792d31227d"),
    "stream_meta": (
        "7b2276223a20312c20226964223a20227265715f70726f6d70745f32222c202274656e616e74223a202261636d65222c2022"
        "6d6f64656c223a202274696e792d72616e646f6d222c2022637265617465645f6174223a2031373030303030303030303030"
        "3030303030317d"),
    "announcement": (
        "7b2276223a20312c2022776f726b6572223a202267656e2d31222c20226d6f64656c223a202274696e792d72616e646f6d22"
        "2c20227265616479223a20747275652c20226d61785f6261746368223a20382c202272756e6e696e67223a20322c20226163"
        "74697665223a20332c2022706964223a20343234322c202273747265616d73223a205b2261222c202262225d2c2022646576"
        "696365223a2022637075222c202274746c5f73223a20362e302c20227473223a20313730303030303030302e32352c202266"
        "7265655f626c6f636b73223a203130302c2022626c6f636b5f73697a65223a2031367d"),
    "indexed_request": (
        "7b2276223a20312c202272657175657374223a207b2276223a20312c20226964223a20227265715f6d657373616765735f31"
        "222c20226d6f64656c223a2022736d6f6c6c6d322d3133356d222c202270726f6d7074223a206e756c6c2c20226d65737361"
        "676573223a205b7b22726f6c65223a202273797374656d222c2022636f6e74656e74223a20226265206272696566227d2c20"
        "7b22726f6c65223a202275736572222c2022636f6e74656e74223a2022685c75303065396c6c6f205c75643833645c756463"
        "3462227d5d2c2022696e7075745f696473223a206e756c6c2c2022706172616d73223a207b226d61785f746f6b656e73223a"
        "20372c202274656d7065726174757265223a20302e352c2022746f705f70223a20302e392c2022746f705f6b223a2034302c"
        "202273746f70223a205b225c6e222c2022454e44225d2c202273656564223a20332c202269676e6f72655f656f73223a2066"
        "616c73657d2c2022636f616c65736365223a207b226d61785f746f6b656e73223a206e756c6c2c20226d61785f64656c6179"
        "5f6d73223a206e756c6c7d2c202274656e616e74223a202261636d65222c2022637265617465645f6174223a203137303030"
        "30303030303132333435363738397d2c20227472616365706172656e74223a202230302d3061663736353139313663643433"
        "6464383434386562323131633830333139632d623761643662373136393230333333312d3031227d"),
}


@pytest.mark.parametrize("name", sorted(OLD_BYTES))
def test_bytes_written_before_msgspec_decode_to_the_same_values(name: str) -> None:
    value = WIRE_VALUES[name]
    old = bytes.fromhex(OLD_BYTES[name])
    assert type(value).decode(old) == value
    new = value.encode()
    if old.startswith(b"{"):  # JSON: the same object (json.dumps spaced it; msgspec does not)
        assert json.loads(new) == json.loads(old)
    else:  # msgpack: byte for byte what the old encoder wrote, so old readers read it unchanged
        assert new == old
