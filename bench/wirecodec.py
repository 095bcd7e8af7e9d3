"""Wire codec study: the NATS hot path (a token batch's encode and decode, a request's decode) as
the hand-written msgpack codec did it, as pydantic TypeAdapters do it and as msgspec Structs do it,
and as :mod:`tokenpipe.wire` does it now.

    python -m bench.wirecodec [--seconds 0.3] [--out bench/out/wirecodec.json]

Self-contained (only ``main()``): the hand-written codec (as the wire had it) and the candidates are
declared here over the same shapes and bounds; msgspec's token batch is the shipped one. Each cell
is µs per call (the best of five timing runs) and its ratio to the hand-written codec's, same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Required

import msgpack
import msgspec
from pydantic import Field, StringConstraints, TypeAdapter
from rich.console import Console
from rich.table import Table
from typing_extensions import TypedDict

from tokenpipe.params import CoalesceParams, SamplingParams, validated
from tokenpipe.wire import Request, TokenBatch, Usage

# -- the values every codec encodes and decodes ---------------------------------------------------
BATCH: dict[str, Any] = {"id": "Zq3c1c0bRr2pYH2x4J9aGQ", "seq": 17, "index": 68, "token_ids": (464, 3290, 11, 290),
                         "text": " the cat, and", "timings": {"first_token": 1_700_000_000_200_000_000,
                                                              "emitted": 1_700_000_000_200_004_000}}
FINAL: dict[str, Any] = {**BATCH, "token_ids": (13,), "text": ".", "finish": "length"}
REQUEST: dict[str, Any] = {
    "v": 1, "id": "Zq3c1c0bRr2pYH2x4J9aGQ", "model": "smollm2-135m", "prompt": None,
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}],
    "input_ids": None,
    "params": {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stop": ["\n\n"], "seed": 7,
               "ignore_eos": False},
    "coalesce": {"max_tokens": None, "max_delay_ms": None}, "tenant": "acme", "created_at": 1_700_000_000_000_000_000}

_Text = Annotated[str, StringConstraints(strict=True)]
_Name = Annotated[str, StringConstraints(strict=True, min_length=1)]
_TokenId = Annotated[int, Field(strict=True, ge=0, lt=1 << 31)]


# -- hand-written: a dict built field by field, read back field by field ---------------------------
@dataclass(frozen=True, slots=True)
class HandBatch:
    id: str
    seq: int
    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: str | None = None
    error: str | None = None
    usage: Mapping[str, int] | None = None
    timings: Mapping[str, int] = field(default_factory=dict)
    error_code: str | None = None

    def encode(self) -> bytes:
        return msgpack.packb({"v": 1, "id": self.id, "seq": self.seq, "index": self.index,
                              "token_ids": list(self.token_ids), "text": self.text, "finish": self.finish,
                              "error": self.error, "usage": dict(self.usage) if self.usage else None,
                              "timings": dict(self.timings), "error_code": self.error_code}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> HandBatch:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if not isinstance(obj, dict) or not isinstance(obj.get("v"), int):
            raise ValueError("bad batch")
        if obj.get("finish") not in (None, "stop", "length", "cancelled", "error"):
            raise ValueError("bad finish")
        usage = obj.get("usage")
        return cls(id=str(obj["id"]), seq=int(obj["seq"]), index=int(obj["index"]),
                   token_ids=tuple(int(t) for t in obj.get("token_ids") or ()), text=str(obj.get("text") or ""),
                   finish=obj.get("finish"), error=obj.get("error"),
                   usage={"prompt_tokens": int(usage["prompt_tokens"]),
                          "completion_tokens": int(usage["completion_tokens"])} if usage else None,
                   timings={str(k): int(v) for k, v in (obj.get("timings") or {}).items()},
                   error_code=obj.get("error_code"))


class _RequestFields(TypedDict, total=False):
    id: Required[_Name]
    model: Required[_Name]
    prompt: _Text
    messages: Annotated[tuple[dict[str, _Text], ...], Field(min_length=1)]
    input_ids: tuple[_TokenId, ...]
    tenant: _Text
    created_at: Annotated[int, Field(strict=True)]


_HAND_FIELDS = TypeAdapter(_RequestFields)


def hand_request(data: bytes) -> dict[str, Any]:
    """Unpack, check ``v``, then three validators: the request's own fields, its params, its coalesce."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(obj, dict) or not isinstance(obj.get("v"), int):
        raise ValueError("bad request")
    fields = validated(_HAND_FIELDS, {k: obj.get(k) for k in _RequestFields.__annotations__}, "request")
    return {**fields, "params": SamplingParams.from_map(obj.get("params")),
            "coalesce": CoalesceParams.from_map(obj.get("coalesce"))}


# -- pydantic: one TypeAdapter per shape; msgpack turns its Python values into bytes ----------------
@dataclass(frozen=True, slots=True)
class PydUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class PydBatch:
    id: str
    seq: int
    index: int
    v: int = 1
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: Literal["stop", "length", "cancelled", "error"] | None = None
    error: str | None = None
    usage: PydUsage | None = None
    timings: dict[str, int] = field(default_factory=dict)
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class PydRequest:
    id: _Name
    model: _Name
    v: int = 1
    prompt: _Text | None = None
    messages: Annotated[tuple[dict[str, _Text], ...], Field(min_length=1)] | None = None
    input_ids: tuple[_TokenId, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    coalesce: CoalesceParams = field(default_factory=CoalesceParams)
    tenant: _Text = "default"
    created_at: Annotated[int, Field(strict=True)] = 0


_PYD_BATCH = TypeAdapter(PydBatch)
_PYD_REQUEST = TypeAdapter(PydRequest)


def _pyd_request_map() -> dict[str, Any]:
    """The request map without nulls (pydantic's None for a non-optional field is an error, not a default)."""
    params = {k: v for k, v in REQUEST["params"].items() if v is not None}
    return {**{k: v for k, v in REQUEST.items() if v is not None}, "params": params, "coalesce": {}}


# -- msgspec: a Struct per shape (the token batch is the shipped one); a request's sampling bounds
# are pydantic's (SamplingParams'), so they are validated by it first -------------------------------
class MsMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


_MsName = Annotated[str, msgspec.Meta(min_length=1)]


class MsRequest(msgspec.Struct, frozen=True, tag_field="v", tag=1):
    id: _MsName
    model: _MsName
    prompt: str | None = None
    messages: Annotated[tuple[MsMessage, ...], msgspec.Meta(min_length=1)] | None = None
    input_ids: tuple[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)], ...] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    coalesce: CoalesceParams = msgspec.field(default_factory=CoalesceParams)
    tenant: str = "default"
    created_at: int = 0


def ms_request(data: bytes) -> MsRequest:
    obj = {k: v for k, v in msgspec.msgpack.decode(data).items() if v is not None}
    return msgspec.convert({**obj, "params": SamplingParams.from_map(obj.get("params")),
                            "coalesce": CoalesceParams.from_map(obj.get("coalesce"))}, MsRequest)


# -- the study ------------------------------------------------------------------------------------
def _time(fn: Callable[[], object], seconds: float) -> float:
    """µs per call: the best of five runs of about ``seconds`` each."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    number = max(1, int(number * seconds / 0.2))
    return min(timer.repeat(5, number)) / number * 1e6


def _cases() -> dict[str, dict[str, Callable[[], object]]]:
    hand_batch, hand_final = HandBatch(**BATCH), HandBatch(**FINAL, usage={"prompt_tokens": 9, "completion_tokens": 69})
    pyd_batch = PydBatch(**BATCH)
    pyd_final = PydBatch(**FINAL, usage=PydUsage(9, 69, 78))
    ms_batch, ms_final = TokenBatch(**BATCH), TokenBatch(**FINAL, usage=Usage(9, 69))
    request = msgpack.packb(REQUEST)
    pyd_request = msgpack.packb(_pyd_request_map())
    pyd_bytes, pyd_final_bytes = (msgpack.packb(_PYD_BATCH.dump_python(b)) for b in (pyd_batch, pyd_final))
    hand_bytes, hand_final_bytes = hand_batch.encode(), hand_final.encode()
    ms_bytes, ms_final_bytes = ms_batch.encode(), ms_final.encode()
    return {
        "hand-written": {
            "batch encode": hand_batch.encode, "final batch encode": hand_final.encode,
            "batch decode": lambda: HandBatch.decode(hand_bytes),
            "final batch decode": lambda: HandBatch.decode(hand_final_bytes),
            "request decode": lambda: hand_request(request),
        },
        "pydantic": {
            "batch encode": lambda: msgpack.packb(_PYD_BATCH.dump_python(pyd_batch)),
            "final batch encode": lambda: msgpack.packb(_PYD_BATCH.dump_python(pyd_final)),
            "batch decode": lambda: _PYD_BATCH.validate_python(msgpack.unpackb(pyd_bytes)),
            "final batch decode": lambda: _PYD_BATCH.validate_python(msgpack.unpackb(pyd_final_bytes)),
            "request decode": lambda: _PYD_REQUEST.validate_python(msgpack.unpackb(pyd_request)),
        },
        "msgspec": {
            "batch encode": ms_batch.encode, "final batch encode": ms_final.encode,
            "batch decode": lambda: TokenBatch.decode(ms_bytes),
            "final batch decode": lambda: TokenBatch.decode(ms_final_bytes),
            "request decode": lambda: ms_request(request),
        },
        "tokenpipe.wire": {  # what ships: msgspec's batch, pydantic's request (see tokenpipe/wire/request.py)
            "batch encode": ms_batch.encode, "final batch encode": ms_final.encode,
            "batch decode": lambda: TokenBatch.decode(ms_bytes),
            "final batch decode": lambda: TokenBatch.decode(ms_final_bytes),
            "request decode": lambda: Request.decode(request),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long each timing run takes")
    parser.add_argument("--out", default="bench/out/wirecodec.json")
    args = parser.parse_args(argv)
    cases = _cases()
    base = cases["hand-written"]
    us = {codec: {op: _time(fn, args.seconds) for op, fn in ops.items()} for codec, ops in cases.items()}
    table = Table(title="wire codec, µs per call (ratio to the hand-written codec)")
    table.add_column("operation")
    for codec in cases:
        table.add_column(codec, justify="right")
    for op in base:
        table.add_row(op, *(f"{us[c][op]:.2f} ({us[c][op] / us['hand-written'][op]:.2f}x)" for c in cases))
    Console(width=150).print(table)
    rows = [{"codec": c, "operation": op, "us": us[c][op], "ratio": us[c][op] / us["hand-written"][op]}
            for c in cases for op in base]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"versions": {"msgspec": msgspec.__version__, "msgpack": msgpack.version,
                                            "python": sys.version.split()[0]}, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
