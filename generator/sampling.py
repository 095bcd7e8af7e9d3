"""Per-row sampling for a batch: greedy rows by argmax, the rest with their own RNG.

Each sequence owns a ``torch.Generator`` so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpipe.wire import SamplingParams

__all__ = ["RowSampler", "sample"]


@dataclass
class RowSampler:
    """One sequence's sampling state."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None

    @classmethod
    def from_params(cls, params: SamplingParams, device: torch.device) -> RowSampler:
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return cls(params.temperature, params.top_p, params.top_k, gen)

    @property
    def greedy(self) -> bool:
        return self.generator is None


def _filter(logits: Tensor, s: RowSampler) -> Tensor:
    # logits [V] (float32) -> filtered logits [V] with -inf outside top-k / nucleus
    # A denormal temperature (5e-324 passes "> 0") would overflow the logits to inf and the softmax to NaN.
    logits = logits / max(s.temperature, 1e-6)
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = cum - sorted_logits.softmax(-1) >= s.top_p
        drop_sorted[0] = False  # a top_p below float32's range (5e-324) compares as 0 and would drop all: NaN
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample(logits: Tensor, samplers: list[RowSampler]) -> list[int]:
    """``logits [B, V]`` -> one token id per row."""
    logits = logits.float()  # bf16 argmax/softmax are slow on CPU and coarse
    greedy = logits.argmax(-1).tolist()  # one vectorised pass covers every greedy row
    out: list[int] = []
    for row, s in enumerate(samplers):
        if s.greedy:
            out.append(int(greedy[row]))
            continue
        probs = _filter(logits[row].float(), s).softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=s.generator).item()))
    return out
