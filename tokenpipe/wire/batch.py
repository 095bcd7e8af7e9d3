"""The token batch: a coalesced run of one stream's tokens (msgpack on its stream), and the usage
its final batch carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from ..errors import WireFormatError
from .codec import WIRE_VERSION, now_ns, pack, unpack

__all__ = ["FINISH_REASONS", "FinishReason", "TokenBatch", "Usage"]

FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_map(self) -> dict[str, int]:
        return {**asdict(self), "total_tokens": self.total_tokens}


@dataclass(frozen=True, slots=True)
class TokenBatch:
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
    timings: Mapping[str, int] = field(default_factory=dict)
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
        return pack(
            {
                "v": WIRE_VERSION,
                "id": self.id,
                "seq": self.seq,
                "index": self.index,
                "token_ids": list(self.token_ids),
                "text": self.text,
                "finish": self.finish,
                "error": self.error,
                "usage": self.usage.to_map() if self.usage else None,
                "timings": dict(self.timings),
                "error_code": self.error_code,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> TokenBatch:
        obj = unpack(data, "token batch")
        try:
            finish = obj.get("finish")
            if finish is not None and finish not in FINISH_REASONS:
                raise WireFormatError(f"token batch: unknown finish reason {finish!r}")
            usage = obj.get("usage")
            return cls(
                id=str(obj["id"]),
                seq=int(obj["seq"]),
                index=int(obj["index"]),
                token_ids=tuple(int(t) for t in obj.get("token_ids") or ()),
                text=str(obj.get("text") or ""),
                finish=finish,
                error=obj.get("error"),
                usage=Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"])) if usage else None,
                timings={str(k): int(v) for k, v in (obj.get("timings") or {}).items()},
                error_code=obj.get("error_code"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"token batch: bad field ({exc})") from exc

    def to_json(self) -> dict[str, Any]:
        """One JSON object per batch, as ``tokenpipe replay --json`` and ``tokenpipe submit --json``
        print it (the native SSE API's events have their own shape: see ``relay/native.py``)."""
        out: dict[str, Any] = {
            "id": self.id,
            "seq": self.seq,
            "index": self.index,
            "token_ids": list(self.token_ids),
            "text": self.text,
        }
        if self.finish is not None:
            out["finish"] = self.finish
        if self.error is not None:
            out["error"] = self.error
            out["error_code"] = self.error_code
        if self.usage is not None:
            out["usage"] = self.usage.to_map()
        if self.timings:
            out["timings"] = dict(self.timings)
        return out
