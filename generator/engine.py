"""Continuous batching: a batch of sequences in cache slots, admitted and retired between steps.

The engine is single-threaded and transport-free. Each :meth:`Engine.step` admits
waiting sequences into free slots (one batched prefill, bounded by a token budget),
runs one decode step for the sequences already running, samples, and retires
finished sequences, compacting the batch so the cache rows stay ``0..B-1``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenpipe.errors import InvalidRequest
from tokenpipe.wire import FinishReason, SamplingParams

from .forward import SlotKVCache, decode_step, prefill
from .models import LoadedModel
from .sampling import RowSampler, sample

__all__ = ["Engine", "Sequence", "StepOutput"]

log = logging.getLogger(__name__)

_ATTEND_ROUND = 32  # attended cache length is rounded up to this (fewer distinct shapes)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. ``prompt`` includes any tokens carried over on resume."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    sampler: RowSampler
    generated: list[int] = field(default_factory=list)
    row: int = -1
    finish: FinishReason | None = None
    cancelled: bool = False
    admitted_ns: int = 0

    @property
    def next_position(self) -> int:
        """Cache position of the last sampled token (the next decode input)."""
        return len(self.prompt) + len(self.generated) - 1


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq: Sequence
    token: int | None  # None when the sequence ended without a new token (cancel)
    finish: FinishReason | None


class Engine:
    """Slot-based continuous batching over a :class:`LoadedModel`."""

    def __init__(self, loaded: LoadedModel, *, max_batch: int = 32, max_seq_len: int = 2048,
                 prefill_token_budget: int = 4096, max_prompt_tokens: int = 0) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len, loaded.max_context)
        self.prefill_token_budget = max(prefill_token_budget, 1)
        self.max_prompt_tokens = max_prompt_tokens or self.max_seq_len - 1
        self.cache = SlotKVCache(self.model, max_batch, self.max_seq_len, loaded.device, loaded.dtype)
        self.rows: list[Sequence] = []  # running, index == cache row
        self.waiting: deque[Sequence] = deque()
        self.last_step_batch = 0

    # -- admission -------------------------------------------------------------------
    def new_sequence(self, seq_id: str, prompt: list[int], params: SamplingParams, carried: int = 0) -> Sequence:
        """Validate and build a sequence; raises :class:`InvalidRequest` if it cannot run.

        ``carried`` trailing prompt tokens were generated earlier (crash continuation): they count
        against the context and ``max_tokens`` but not against the prompt-length limit."""
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = int(self.model.config.vocab_size)
        if max(prompt) >= vocab:
            raise InvalidRequest(f"token id {max(prompt)} is outside the vocabulary ({vocab})", param="input_ids")
        room = self.max_seq_len - len(prompt)
        if len(prompt) - carried > self.max_prompt_tokens and room >= 1:
            raise InvalidRequest(f"prompt has {len(prompt) - carried} tokens; the limit here is "
                                 f"{self.max_prompt_tokens}", param="prompt")
        if room < 1:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens; this model's context is {self.max_seq_len}", param="prompt"
            )
        return Sequence(id=seq_id, prompt=list(prompt), params=params, max_new=min(params.max_tokens, room),
                        sampler=RowSampler.from_params(params, self.device))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, seq_id: str) -> bool:
        """Mark a sequence; it leaves the batch (and frees its slot) at the next step."""
        for seq in (*self.rows, *self.waiting):
            if seq.id == seq_id:
                seq.cancelled = True
                return True
        return False

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire ``seq`` now (e.g. a stop string matched): its slot is reused next step."""
        if seq.finish is None:
            seq.finish = reason
            self._retire()

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    # -- one step --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out: list[StepOutput] = []
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.finish = "cancelled"
            out.append(StepOutput(seq, None, "cancelled"))
        for seq in self.rows:
            if seq.cancelled and seq.finish is None:
                seq.finish = "cancelled"
                out.append(StepOutput(seq, None, "cancelled"))
        self._retire()

        decoding = len(self.rows)  # rows admitted below get their first token from prefill
        admitted = self._admit()
        if admitted:
            out += self._prefill(admitted)
        if decoding:
            out += self._decode(decoding)
        self._retire()
        self.last_step_batch = decoding + len(admitted)
        return out

    def _admit(self) -> list[Sequence]:
        batch: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.rows) + len(batch) < self.max_batch:
            nxt = self.waiting[0]
            longest_if = max(longest, len(nxt.prompt))
            if batch and longest_if * (len(batch) + 1) > self.prefill_token_budget:
                break
            batch.append(self.waiting.popleft())
            longest = longest_if
        return batch

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        first = len(self.rows)
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s.prompt)] = torch.tensor(s.prompt)
            s.row = first + i
            s.admitted_ns = time.time_ns()
        lengths = torch.tensor([len(s.prompt) for s in seqs])
        logits = prefill(self.model, self.cache, ids.to(self.device), lengths.to(self.device), first)  # [N, V]
        self.rows.extend(seqs)
        return self._accept(seqs, logits)

    def _decode(self, count: int) -> list[StepOutput]:
        seqs = self.rows[:count]
        positions = [s.next_position for s in seqs]
        attend = min(self.cache.max_len, -(-(max(positions) + 1) // _ATTEND_ROUND) * _ATTEND_ROUND)
        self.cache.ensure(attend)
        tokens = torch.tensor([s.generated[-1] for s in seqs], device=self.device)
        pos = torch.tensor(positions, device=self.device)
        logits = decode_step(self.model, self.cache, tokens, pos, attend)  # [B, V]
        return self._accept(seqs, logits)

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        tokens = sample(logits, [s.sampler for s in seqs])
        eos = self.loaded.eos_ids
        out = []
        for seq, tok in zip(seqs, tokens, strict=False):
            seq.generated.append(tok)
            if tok in eos and not seq.params.ignore_eos:
                seq.finish = "stop"
            elif len(seq.generated) >= seq.max_new:
                seq.finish = "length"
            out.append(StepOutput(seq, tok, seq.finish))
        return out

    def _retire(self) -> None:
        """Drop finished rows, moving the last row into each hole (rows stay 0..B-1)."""
        i = 0
        while i < len(self.rows):
            if self.rows[i].finish is None:
                i += 1
                continue
            last = self.rows.pop()
            if i == len(self.rows):
                break  # the finished row was the last one
            if last.finish is None:
                # positions 0..next_position-1 are cached; the last sampled token is not yet
                self.cache.move(last.row, i, min(self.cache.cap, last.next_position))
            last.row = i
            self.rows[i] = last  # not advancing i: the moved row may be finished too

    # -- convenience -----------------------------------------------------------------
    def run_to_completion(self) -> list[StepOutput]:
        """Step until idle; for tests and in-process benchmarks."""
        outputs: list[StepOutput] = []
        while not self.idle:
            outputs += self.step()
        return outputs
