"""Token coalescing: the pure window logic, no clock and no transport of its own.

The first token of a request is released at once (TTFT never waits). After it,
tokens accumulate until ``max_tokens`` are pending (count window) or ``max_delay_ns``
has passed since the first pending token (time window); a final batch is released
immediately. ``max_tokens == 0`` or ``max_delay_ns == 0`` means every token.

A token that comes ``max_delay_ns`` or more after the previous one is released at once as
well: the stream is decoding slower than the window, so the next token would most likely
come after the window closed and holding this one would only delay it (a loaded CPU
engine, or a large batch, steps slower than a 20 ms window).

Batches carry ``seq`` and ``index`` so a consumer can prove nothing was lost.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenpipe.wire import FinishReason, TokenBatch, Usage

__all__ = ["Coalescer"]


class Coalescer:
    def __init__(self, stream_id: str, *, max_tokens: int, max_delay_ns: int, start_seq: int = 0,
                 start_index: int = 0, first_timings: Mapping[str, int] | None = None) -> None:
        self.stream_id = stream_id
        self.max_tokens = max_tokens
        self.max_delay_ns = max_delay_ns
        self.seq = start_seq
        self.index = start_index
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.pending_since: int | None = None
        self.first_timings = dict(first_timings or {})
        self.released = False  # nothing published yet by this coalescer: next token goes at once
        self.last_token_ns: int | None = None
        self.done = False

    def deadline(self) -> int | None:
        """When the time window closes for what is pending (ns), or None if nothing is."""
        if self.pending_since is None:
            return None
        return self.pending_since + self.max_delay_ns

    def add(self, token_ids: list[int], text: str, now_ns: int, *, finish: FinishReason | None = None,
            error: str | None = None, usage: Usage | None = None, error_code: str | None = None) -> TokenBatch | None:
        """Add what one step produced; return a batch if a window (or the end) says so."""
        if self.done:
            raise RuntimeError(f"stream {self.stream_id} already finished")
        slow = False
        if token_ids or text:
            if self.pending_since is None:
                self.pending_since = now_ns
            self.tokens.extend(token_ids)
            self.text.append(text)
        if token_ids:
            slow = self.last_token_ns is not None and now_ns - self.last_token_ns >= self.max_delay_ns
            self.last_token_ns = now_ns
        if (
            finish is not None
            or not self.released
            or self.max_tokens == 0
            or self.max_delay_ns == 0
            or slow
            or len(self.tokens) >= self.max_tokens
            or (self.pending_since is not None and now_ns - self.pending_since >= self.max_delay_ns)
        ):
            if finish is None and not self.tokens and not any(self.text):
                return None
            return self._flush(now_ns, finish, error, usage, error_code)
        return None

    def due(self, now_ns: int) -> TokenBatch | None:
        """Release pending tokens whose time window has closed."""
        deadline = self.deadline()
        if deadline is not None and now_ns >= deadline:
            return self._flush(now_ns, None, None, None)
        return None

    def _flush(self, now_ns: int, finish: FinishReason | None, error: str | None, usage: Usage | None,
               error_code: str | None = None) -> TokenBatch:
        timings = {"first_token": self.pending_since or now_ns, "emitted": now_ns}
        if not self.released:
            timings.update(self.first_timings)
        batch = TokenBatch(
            id=self.stream_id,
            seq=self.seq,
            index=self.index,
            token_ids=tuple(self.tokens),
            text="".join(self.text),
            finish=finish,
            error=error,
            usage=usage,
            timings=timings,
            error_code=error_code,
        )
        self.seq += 1
        self.index += len(self.tokens)
        self.tokens, self.text, self.pending_since = [], [], None
        self.released = True
        self.done = finish is not None
        return batch
