"""The slot KV cache the paged one replaced, kept only as the A/B reference of ``bench.kvcache``.

This is ``generator/forward.py``'s and ``generator/engine.py``'s slot cache as of the commit
before the paged cache (per-layer ``[slots, G, cap, hd]``, ``cap`` grown to the longest
sequence for every slot, a retiring row compacted by copying its K/V). The generator no longer
uses it; it lives here so that memory and throughput are compared in one run.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from generator.engine.scheduler import Engine, Sequence, StepOutput
from generator.model.attention import FP32_ATTENTION_ROWS
from generator.model.layers import mlp_block as _mlp_block
from generator.model.layers import qkv as _qkv
from generator.model.layers import rotary as _rotary
from generator.model.loader import LoadedModel
from generator.model.plan import plan_for

__all__ = ["SlotEngine", "SlotKVCache"]

_ATTEND_ROUND = 32

_GROW = 256  # cache length grows in these steps, so shapes stay few and copies rare


class SlotKVCache:
    """Per-layer K/V tensors ``[slots, G, cap, hd]``; ``cap`` grows on demand up to ``max_len``."""

    def __init__(self, model: Any, slots: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = model.config
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.slots = slots
        self.max_len = max_len
        self.device, self.dtype = device, dtype
        self.cap = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.ensure(min(_GROW, max_len))

    def ensure(self, length: int) -> None:
        """Make room for positions ``< length`` (copying what is cached)."""
        if length <= self.cap:
            return
        new_cap = min(self.max_len, -(-length // _GROW) * _GROW)
        if new_cap < length:
            raise ValueError(f"sequence length {length} exceeds the cache's max_len {self.max_len}")
        shape = (self.slots, self.kv_heads, new_cap, self.head_dim)
        k_new = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        v_new = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        for old, new in zip(self.k + self.v, k_new + v_new, strict=False):
            new[:, :, : self.cap].copy_(old)
        self.k, self.v, self.cap = k_new, v_new, new_cap

    @torch.inference_mode()  # a cache grown inside the forward holds inference tensors: in-place needs the mode
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst`` (compaction)."""
        for t in self.k + self.v:
            t[dst, :, :length].copy_(t[src, :, :length])



@torch.inference_mode()
def slot_prefill(model: Any, cache: SlotKVCache, input_ids: Tensor, lengths: Tensor, first_slot: int) -> Tensor:
    """Run right-padded prompts ``input_ids [N, S]`` into slots ``first_slot..first_slot+N-1``.

    Returns the logits of each row's last real token, ``[N, V]``. Padding sits after the
    real tokens, so causal attention never lets a real token see it; its K/V land in
    cache positions that stay masked until overwritten by real tokens.
    """
    inner, plan = model.model, plan_for(model)
    N, S = input_ids.shape
    cache.ensure(S)
    pos = torch.arange(S, device=input_ids.device).expand(N, S)  # [N, S]
    x = inner.embed_tokens(input_ids)  # [N, S, D]
    rot = _rotary(*inner.rotary_emb(x, pos))  # cos/sin [N, S, hd]
    rows = slice(first_slot, first_slot + N)
    for li, (layer, lp) in enumerate(zip(inner.layers, plan.layers, strict=True)):
        attn = layer.self_attn
        q, k, v = _qkv(attn, lp, layer.input_layernorm(x), rot, cache.head_dim)
        cache.k[li][rows, :, :S] = k
        cache.v[li][rows, :, :S] = v
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        x = x + lp.o(o.transpose(1, 2).reshape(N, S, -1))  # [N, S, D]
        x = _mlp_block(layer, lp, x)
    last = x[torch.arange(N, device=x.device), lengths - 1]  # [N, D]: only these rows need logits
    return plan.lm_head(inner.norm(last))  # [N, V]




def _slot_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Single-query attention with grouped KV heads, as two small batched matmuls.

    For one query token this is several times faster on CPU than SDPA's flash kernel with
    a mask (measured in bf16), and needs no repeat of K/V per query head. A bf16 cache is read
    in fp32 for up to :data:`FP32_ATTENTION_ROWS` rows: CPU bf16 matmuls this small cost more
    than the cast (SmolLM2's shapes, 2 threads, AVX512-BF16: per layer 50 → 36 µs at one row,
    53 → 42 at two, even at four, 77 → 94 at eight; the whole decode step 1.11x at one and two
    rows, bf16 + int4, 8 alternating rounds).
    q [B, H, 1, hd]; k, v [B, G, T, hd]; mask [B, 1, 1, T] (True = attend) -> [B, H, 1, hd]
    """
    B, H, _, hd = q.shape
    G = k.shape[1]
    out_dtype = q.dtype
    if B <= FP32_ATTENTION_ROWS and q.device.type == "cpu" and q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    qg = q.view(B, G, H // G, hd)  # query heads h = g * (H/G) + r share kv head g
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, G, H/G, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).view(B, H, 1, hd).to(out_dtype)


@torch.inference_mode()
def slot_decode_step(model: Any, cache: SlotKVCache, tokens: Tensor, positions: Tensor, attend_len: int) -> Tensor:
    """One token for each of rows ``0..B-1``: ``tokens [B]`` at ``positions [B]``; returns ``[B, V]``.

    ``attend_len`` (T) bounds the cache window read this step (>= max(positions)+1).
    """
    inner, plan = model.model, plan_for(model)
    B = tokens.shape[0]
    rows = torch.arange(B, device=tokens.device)
    x = inner.embed_tokens(tokens[:, None])  # [B, 1, D]
    rot = _rotary(*inner.rotary_emb(x, positions[:, None]))  # cos/sin [B, 1, hd]
    cols = torch.arange(attend_len, device=tokens.device)
    mask = (cols[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, T]
    for li, (layer, lp) in enumerate(zip(inner.layers, plan.layers, strict=True)):
        attn = layer.self_attn
        q, k, v = _qkv(attn, lp, layer.input_layernorm(x), rot, cache.head_dim)  # q [B,H,1,hd] k,v [B,G,1,hd]
        kc, vc = cache.k[li], cache.v[li]
        kc[rows, :, positions] = k[:, :, 0]
        vc[rows, :, positions] = v[:, :, 0]
        o = _slot_attention(q, kc[:B, :, :attend_len], vc[:B, :, :attend_len], mask, attn.scaling)  # [B, H, 1, hd]
        x = x + lp.o(o.transpose(1, 2).reshape(B, 1, -1))
        x = _mlp_block(layer, lp, x)
    return plan.lm_head(inner.norm(x[:, 0]))  # [B, V]


class SlotEngine(Engine):
    """The engine as it was before the paged cache: slots compacted to rows ``0..B-1``."""

    def __init__(self, loaded: LoadedModel, *, max_batch: int = 32, max_seq_len: int = 2048,
                 prefill_token_budget: int = 4096, max_prompt_tokens: int = 0) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len, loaded.max_context)
        self.prefill_token_budget = max(prefill_token_budget, 1)
        self.max_prompt_tokens = max_prompt_tokens or self.max_seq_len - 1
        self.slots = SlotKVCache(self.model, max_batch, self.max_seq_len, loaded.device, loaded.dtype)
        self.rows: list[Sequence] = []  # running, index == cache row
        self.waiting: deque[Sequence] = deque()
        self.last_step_batch = 0
        self.static = None  # Engine._accept samples as after the plain step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        logits = slot_prefill(self.model, self.slots, ids.to(self.device), lengths.to(self.device), first)  # [N, V]
        self.rows.extend(seqs)
        return self._accept(seqs, logits)

    def _decode(self, count: int) -> list[StepOutput]:  # type: ignore[override]
        seqs = self.rows[:count]
        positions = [s.next_position for s in seqs]
        attend = min(self.slots.max_len, -(-(max(positions) + 1) // _ATTEND_ROUND) * _ATTEND_ROUND)
        self.slots.ensure(attend)
        tokens = torch.tensor([s.generated[-1] for s in seqs], device=self.device)
        pos = torch.tensor(positions, device=self.device)
        logits = slot_decode_step(self.model, self.slots, tokens, pos, attend)  # [B, V]
        return self._accept(seqs, logits)

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
                self.slots.move(last.row, i, min(self.slots.cap, last.next_position))
            last.row = i
            self.rows[i] = last  # not advancing i: the moved row may be finished too

