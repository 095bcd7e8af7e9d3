"""Decode steps over static input buffers, captured as CUDA graphs per batch-size bucket.

A decode step of a small model on a GPU is bound by kernel launches, not by the hardware: its
hundreds of small kernels each wait for the Python that launches them. Replaying a captured graph
launches them as one. As vLLM does, the step is captured once per batch-size bucket
(:data:`BUCKETS`) over static buffers: token ids, positions, KV slots and block tables padded
to the largest bucket and to the widest table ``max_seq_len`` needs. A step of ``n`` rows
copies its inputs into the first rows of the buffers, pads the rest of its bucket with rows
that read and write only the scratch block, and replays that bucket's graph. On CPU (and in
tests) the padded step runs eagerly, so the padding is checked against the plain step without a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from tokenpipe.errors import ConfigError

from ..model.forward import decode_step
from ..model.kvcache import BLOCK_SIZE, SCRATCH, PagedKVCache
from .sampling import CANDIDATES, RowSampler, draw, sampled_rows

__all__ = ["BUCKETS", "StaticDecode", "bucket_for", "buckets_for", "pad_rows", "resolve_cuda_graphs",
           "sample_on_device", "table_width"]

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def resolve_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether ``TOKENPIPE_CUDA_GRAPHS`` captures the decode step on ``device``: ``auto`` is on
    with CUDA, off elsewhere; ``on`` without a CUDA device is a :class:`ConfigError` at start."""
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"TOKENPIPE_CUDA_GRAPHS={mode!r}: use one of auto, on, off", param="cuda_graphs")
    if mode == "on" and device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device (TOKENPIPE_CUDA_GRAPHS=on, device {device})",
                          param="cuda_graphs")
    return mode != "off" and device.type == "cuda"


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The buckets a batch of up to ``max_batch`` rows uses: powers of two up to the first that holds it."""
    largest = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= largest)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``rows``; None when none does (the step runs uncaptured)."""
    return next((b for b in buckets if b >= rows), None)


def table_width(max_seq_len: int) -> int:
    """Blocks per row of the static block tables: enough for ``max_seq_len`` positions."""
    return -(-max_seq_len // BLOCK_SIZE)


def pad_rows(tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]], bucket: int,
             width: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A step's inputs padded to ``bucket`` rows and tables to ``width`` blocks (host tensors).

    A padding row is token 0 at position 0 writing its K/V to the scratch block and reading only
    the scratch block; a real row's table is padded with the scratch block, which its mask hides."""
    n = len(tokens)
    if n > bucket or any(len(t) > width for t in tables):
        raise ValueError(f"{n} rows / a table of {max(map(len, tables))} blocks do not fit {bucket} x {width}")
    tok = torch.zeros(bucket, dtype=torch.long)
    pos = torch.zeros(bucket, dtype=torch.long)
    slot = torch.full((bucket,), SCRATCH * BLOCK_SIZE, dtype=torch.long)
    table = torch.full((bucket, width), SCRATCH, dtype=torch.long)
    tok[:n], pos[:n], slot[:n] = torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    return tok, pos, slot, table


class StaticDecode:
    """The decode step over static buffers: captured per bucket on CUDA, eager elsewhere."""

    def __init__(self, model: Any, cache: PagedKVCache, *, max_batch: int, max_seq_len: int,
                 device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.buckets = buckets_for(max_batch)
        self.width = table_width(max_seq_len)
        # the largest bucket's buffers, holding padding rows until a step's inputs are copied in
        self.tokens, self.positions, self.slots, self.tables = (
            t.to(device) for t in pad_rows([], [], [], [], self.buckets[-1], self.width))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}

    def _run(self, bucket: int) -> Tensor:
        return decode_step(self.model, self.cache, self.tokens[:bucket], self.positions[:bucket],
                           self.slots[:bucket], self.tables[:bucket])

    def capture(self, *, strict: bool = False) -> bool:
        """Capture one graph per bucket, largest first (the smaller ones reuse its memory pool).

        A step that cannot be captured (an operation that syncs with the host) is a
        :class:`ConfigError` when ``strict`` (``TOKENPIPE_CUDA_GRAPHS=on``); else it is logged and
        False returned, and the caller runs the plain step."""
        try:
            self._capture_all()
        except RuntimeError as exc:
            self.graphs.clear()
            self.outputs.clear()
            if strict:
                raise ConfigError(f"the decode step could not be captured as a CUDA graph: {exc}",
                                  param="cuda_graphs") from exc
            log.warning("CUDA graph capture failed; decoding without graphs", extra={"error": str(exc)})
            return False
        return True

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        started = time.monotonic()
        for bucket in reversed(self.buckets):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits and allocator growth happen outside the capture
                    self._run(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._run(bucket)
            self.graphs[bucket] = graph
            log.info("captured a decode step", extra={"batch": bucket, "of": len(self.buckets),
                                                       "elapsed_s": round(time.monotonic() - started, 2)})
        torch.cuda.synchronize(self.device)

    def decode(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> Tensor:
        """Logits ``[n, V]`` of one decode step for ``n`` rows, through the static buffers."""
        n = len(tokens)
        bucket = bucket_for(n, self.buckets)
        if bucket is None:  # wider than the largest bucket: the plain step
            host = pad_rows(tokens, positions, slots, tables, n, self.width)
            return decode_step(self.model, self.cache, *(t.to(self.device) for t in host))
        host = pad_rows(tokens, positions, slots, tables, bucket, self.width)
        for buf, src in zip((self.tokens, self.positions, self.slots, self.tables), host, strict=True):
            buf[:bucket].copy_(src, non_blocking=True)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._run(bucket)[:n]
        graph.replay()
        return self.outputs[bucket][:n]


def sample_on_device(logits: Tensor, samplers: list[RowSampler]) -> list[int]:
    """As :func:`generator.engine.sampling.sample`, with one device→host copy: no per-row host syncs.

    Every sampled row's three candidate answers (over the top candidates, plain temperature over
    the vocabulary, over the whole sorted vocabulary) are computed and the right one chosen on
    the device, where ``sample`` asks the host which rows need the wider ones. Each row still
    draws exactly one number from its own generator, so seeded rows give ``sample``'s tokens."""
    logits = logits.float()
    out = logits.argmax(-1)
    rows = [i for i, s in enumerate(samplers) if not s.greedy]
    if rows:
        idx, scaled, top_k, top_p, u, plain = sampled_rows(logits, samplers, rows)
        V = logits.shape[-1]
        width = min(CANDIDATES, V)
        narrow, exact = draw(scaled, top_k, top_p, u, width)
        wide = draw(scaled, top_k, top_p, u, V)[0] if width < V else narrow
        cdf = scaled.softmax(-1).cumsum(-1)
        flat = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=V - 1)
        out[idx] = torch.where(plain, flat, torch.where(exact, narrow, wide))
    return out.tolist()  # the step's one device -> host copy
