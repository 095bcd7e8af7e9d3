"""Sampling for a batch: greedy rows by one argmax, sampled rows together.

Each sampled sequence owns a ``torch.Generator`` and draws exactly one uniform number
from it per token, so a seeded request gives the same tokens whatever else shares its
batch. The sampled rows are filtered (temperature, top-k, top-p) and sampled as one
batch by inverse CDF over their most likely ``CANDIDATES`` tokens; a row whose nucleus
is not inside those (a flat distribution) is sampled over the whole sorted vocabulary
instead, so the result is exact either way. Rows with neither top-k nor top-p are
sampled over the vocabulary in its own order (no ranking needed).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpipe.wire import SamplingParams

__all__ = ["CANDIDATES", "RowSampler", "draw", "sample", "sampled_rows"]

# Candidates per row for the common case: sorting the whole 49k vocabulary per sampled row cost
# over ten times as much; on SmolLM2-Instruct the 0.9 nucleus was
# inside 256 candidates in all 384 rows sampled.
CANDIDATES = 256


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


def draw(logits: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Sample rows of ``logits [R, V]`` (already divided by temperature) over their ``width``
    most likely tokens. Returns ``(tokens [R], exact [R])``: ``exact`` is False where the
    row's kept set may reach beyond ``width`` (the caller redraws those with the whole vocabulary)."""
    V = logits.shape[-1]
    vals, ids = torch.topk(logits, width, dim=-1) if width < V else torch.sort(logits, -1, descending=True)
    ranks = torch.arange(width, device=logits.device)
    in_k = ranks[None, :] < top_k[:, None]  # top-k (0 = off was mapped to V)
    # Probabilities renormalised over the top-k set; without top-k that is the whole vocabulary.
    full_norm = torch.logsumexp(logits, -1, keepdim=True)
    k_norm = torch.logsumexp(vals.masked_fill(~in_k, float("-inf")), -1, keepdim=True)
    norm = torch.where(top_k[:, None] >= V, full_norm, k_norm)
    probs = (vals - norm).exp().masked_fill(~in_k, 0.0)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (always at least one token).
    before = probs.cumsum(-1) - probs
    keep = in_k & (before < top_p[:, None])
    keep[:, 0] = True  # the top token always: a top_p below float32's range (5e-324) compares as 0
    kept = probs.masked_fill(~keep, 0.0)
    mass = kept.sum(-1)
    # Exact when the kept set provably ends inside the candidates: top-k within them, or the
    # nucleus closed (its mass reached top_p) before the last candidate.
    closed = (before[:, -1] + probs[:, -1]) >= top_p if width < V else torch.ones_like(mass, dtype=torch.bool)
    exact = (top_k <= width) | closed
    cdf = kept.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * mass)[:, None], right=True).clamp(max=width - 1)[:, 0]
    # never land on a dropped token (u * mass may round onto the last cdf step)
    pick = torch.minimum(pick, keep.sum(-1) - 1)
    return ids.gather(1, pick[:, None])[:, 0], exact


def sampled_rows(logits: Tensor, samplers: list[RowSampler],
                 rows: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The sampled ``rows`` of ``logits [B, V]`` as tensors: their index, temperature-scaled
    logits, top-k, top-p, one uniform draw each from the row's own generator, and whether the row
    is temperature only (no ranking needed)."""
    chosen = [samplers[i] for i in rows]
    V, dev = logits.shape[-1], logits.device
    # A denormal temperature (5e-324 passes "> 0") would overflow the logits to inf and the softmax to NaN.
    temp = torch.tensor([max(s.temperature, 1e-6) for s in chosen], device=dev)
    top_k = torch.tensor([s.top_k if 0 < s.top_k < V else V for s in chosen], device=dev)
    top_p = torch.tensor([min(max(s.top_p, 0.0), 1.0) for s in chosen], device=dev)
    # one draw per row from the row's own generator: the only per-row Python work
    u = torch.cat([torch.rand(1, generator=s.generator, device=dev) for s in chosen])
    idx = torch.tensor(rows, device=dev)
    # Every row sampled (the common case): no [R, V] copy before the division's own
    scaled = (logits if len(rows) == logits.shape[0] else logits.index_select(0, idx)) / temp[:, None]
    return idx, scaled, top_k, top_p, u, (top_k >= V) & (top_p >= 1.0)


def sample(logits: Tensor, samplers: list[RowSampler]) -> list[int]:
    """``logits [B, V]`` -> one token id per row."""
    logits = logits.float()  # bf16 argmax/softmax are slow on CPU and coarse
    out = logits.argmax(-1)  # one vectorised pass covers every greedy row
    rows = [i for i, s in enumerate(samplers) if not s.greedy]
    if not rows:
        return out.tolist()
    idx, scaled, top_k, top_p, u, plain = sampled_rows(logits, samplers, rows)
    V = logits.shape[-1]
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    is_plain = plain.tolist()
    if any(is_plain):  # temperature only (OpenAI's defaults): no ranking, so no top-k pass to throw away
        where = plain.nonzero()[:, 0]
        cdf = (scaled if all(is_plain) else scaled[where]).softmax(-1).cumsum(-1)
        tokens[where] = torch.searchsorted(cdf, (u[where] * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=V - 1)
    if not all(is_plain):
        ranked = (~plain).nonzero()[:, 0]
        r_scaled, r_k, r_p, r_u = ((scaled, top_k, top_p, u) if not any(is_plain) else
                                   (scaled[ranked], top_k[ranked], top_p[ranked], u[ranked]))
        drawn, exact = draw(r_scaled, r_k, r_p, r_u, min(CANDIDATES, V))
        if not bool(exact.all()):
            redo = (~exact).nonzero()[:, 0]
            drawn[redo] = draw(r_scaled[redo], r_k[redo], r_p[redo], r_u[redo], V)[0]
        tokens[ranked] = drawn
    out[idx] = tokens
    return out.tolist()
