"""Incremental, UTF-8-safe detokenization and stop-string matching.

Text is released only when the decoded suffix no longer ends in U+FFFD, so a
multi-byte character split across tokens is never emitted half-made. A few prompt
tokens seed the window so tokenizers that treat a leading space specially
(SentencePiece) decode the first generated token correctly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

_SEED_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back the newly completed text."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        seed = list(prompt_ids[-_SEED_TOKENS:])
        self.tokens: list[int] = seed
        self.prefix_offset = 0
        self.read_offset = len(seed)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is still held (a truly incomplete byte
        sequence decodes to U+FFFD, exactly as decoding the whole output would)."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(prefix) :]


class StopMatcher:
    """Holds back text that might be the start of a stop string.

    ``feed`` returns ``(text_to_emit, stopped)``; once stopped, the emitted text ends
    just before the stop string (OpenAI semantics: the stop string is not returned).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
