"""The token batch: a coalesced run of one stream's tokens (msgpack on its stream), and the usage
its final batch carries. Both are msgspec Structs: the declaration is the encoder, the decoder
and the validation (the hot path: every batch is encoded once and decoded by every reader)."""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec
from msgspec.structs import asdict, force_setattr

from .codec import WIRE_VERSION, decoded, now_ns, pack

__all__ = ["FINISH_REASONS", "FinishReason", "TokenBatch", "Usage"]

FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int = 0  # always the sum of the two (set here, whatever a map said): readers need not add

    def __post_init__(self) -> None:
        force_setattr(self, "total_tokens", self.prompt_tokens + self.completion_tokens)

    def to_map(self) -> dict[str, int]:
        return asdict(self)


class TokenBatch(msgspec.Struct, frozen=True, tag_field="v", tag=WIRE_VERSION):
    """A coalesced run of tokens for one request.

    ``seq`` numbers batches 0,1,2,...; ``index`` is the position (in generated tokens)
    of the first token here, so consecutive batches satisfy
    ``next.index == prev.index + len(prev.token_ids)``. ``text`` is always complete
    UTF-8. ``timings`` holds wall-clock ns stamps: on every batch ``first_token`` (first
    token of this batch produced) and ``emitted`` (batch published); on a request's first
    batch also ``created`` (request), ``received`` (pulled by the worker) and, once the
    engine took it, ``admitted`` (given a batch slot).
    """

    id: str
    seq: int
    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    timings: dict[str, int] = msgspec.field(default_factory=dict)
    error_code: str | None = None  # machine-readable kind of ``error`` (e.g. "invalid_request")

    @classmethod
    def error_for(cls, stream_id: str, message: str, code: str, *, seq: int = 0, index: int = 0) -> TokenBatch:
        """The final batch that ends a stream in error, after ``seq`` batches holding ``index``
        tokens were published (0 and 0: before any)."""
        return cls(id=stream_id, seq=seq, index=index, finish="error", error=message, error_code=code,
                   usage=Usage(0, index), timings={"emitted": now_ns()})

    @property
    def is_final(self) -> bool:
        return self.finish is not None

    def encode(self) -> bytes:
        return pack(self)

    @classmethod
    def decode(cls, data: bytes) -> TokenBatch:
        return decoded(_DECODER.decode, data, "token batch")

    def to_json(self) -> dict[str, Any]:
        """One JSON object per batch, as ``tokenpipe replay --json`` and ``tokenpipe submit --json``
        print it: the wire's fields less the version and the absent ones (the native SSE API's events
        have their own shape: see ``relay/native.py``)."""
        out = {k: v for k, v in msgspec.to_builtins(self).items() if v is not None and k != "v"}
        if not self.timings:
            del out["timings"]
        if self.error is not None:
            out["error_code"] = self.error_code
        return out


_DECODER = msgspec.msgpack.Decoder(TokenBatch)
