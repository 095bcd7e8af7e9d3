"""The one-row decode step compiled by torch.compile (inductor) on CPU, one graph per attended length.

At one stream on a CPU about half of an eager decode step is not matrix work: norms, RoPE,
attention over the cache, residuals and the Python that dispatches each of those small ops
(bench/RESULTS.md, "The other half of the step"). Inductor fuses that half into generated C++
and calls the projections' kernels from it, so the step takes about 0.7× the eager time
(bench/RESULTS.md, "issue 21, part 3"). It does so for static shapes only: as
:mod:`generator.cudagraph` pads to batch buckets on CUDA, a one-row step here is padded to
the smallest of a few table widths (:func:`widths_for`: 128, 256, 512 … positions) and each
width is its own graph, all compiled when the engine starts, with progress logged (no step
ever waits for a compile). Steps of more rows, where projections dominate, run eagerly.

Each graph is C++ end to end (inductor's ``cpp_wrapper``: the code that calls the kernels is
C++ too). Compiling costs about 3 min a graph on 2 cores the first time and about 12 s from inductor's
on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, which the generator points into its data dir), so
``TOKENPIPE_DECODE_COMPILE`` is ``off`` unless asked for. Where the kernel library is built, the eager
one-row step runs its decoder layers in one call (:mod:`generator.stack`) and beats the compiled step
(bench/RESULTS.md, "issue 21, part 13"); compiling pays where the library is not built.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tokenpipe.errors import ConfigError

from .cudagraph import pad_rows, table_width
from .forward import decode_step
from .kvcache import BLOCK_SIZE, SCRATCH, PagedKVCache

__all__ = ["FIRST_WIDTH", "MAX_GRAPHS", "CompiledDecode", "resolve_decode_compile", "widths_for"]

log = logging.getLogger(__name__)

FIRST_WIDTH = 8  # blocks (128 positions): the narrowest graph
MAX_GRAPHS = 8  # torch._dynamo's recompile limit per function; longer contexts decode eagerly


def resolve_decode_compile(mode: str, device: torch.device) -> bool:
    """Whether ``TOKENPIPE_DECODE_COMPILE`` compiles the one-row step on ``device``: ``on`` is
    refused off the CPU (CUDA graphs serve there), anything but ``on``/``off`` at start."""
    if mode not in ("on", "off"):
        raise ConfigError(f"TOKENPIPE_DECODE_COMPILE={mode!r}: use on or off", param="decode_compile")
    if mode == "on" and device.type != "cpu":
        raise ConfigError(f"the compiled decode step is for CPUs (device {device}); CUDA graphs serve on CUDA",
                          param="decode_compile")
    return mode == "on"


def widths_for(max_seq_len: int) -> tuple[int, ...]:
    """Table widths (blocks) with a graph each: doubling from :data:`FIRST_WIDTH` to the first that
    holds ``max_seq_len`` positions, at most :data:`MAX_GRAPHS` of them."""
    widest, w = table_width(max_seq_len), FIRST_WIDTH
    out: list[int] = []
    while len(out) < MAX_GRAPHS:
        out.append(min(w, widest))
        if w >= widest:
            break
        w *= 2
    return tuple(out)


def _private(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own: dynamo keeps its compiled graphs per code object, so
    graphs compiled through the copy are found only through the copy."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledDecode:
    """One-row decode steps through compiled graphs, one per width of :func:`widths_for`."""

    def __init__(self, model: Any, cache: PagedKVCache, *, max_seq_len: int) -> None:
        self.model, self.cache = model, cache
        self.widths = widths_for(max_seq_len)
        self.steps = 0  # steps decoded through a graph (the rest ran eagerly)
        # The undecorated step under no_grad: compiling through inference_mode fails in dynamo
        # ("Cannot set version_counter for inference tensor"). Without inductor's size asserts: they
        # check ~600 kernel outputs' shapes a step from Python, ~7 % of a one-row step here
        # (bench/RESULTS.md, "issue 21, part 4"); dynamo's guards still check every input's. With a
        # C++ wrapper: the Python one cost ~2.3 ms of a ~20 ms step in calls (0.88×, "issue 21, part 5"),
        # for twice the first compile (~3 min a graph against ~90 s; ~12 s from the cache either way).
        # Without dynamo's guards on the model's modules: ~4,000 of a graph's ~4,500 guards, checked
        # before every step (1.5 ms of a ~16 ms step, "issue 21, part 10"). The model does not change
        # once the engine runs (the kernel table is applied before the compile), and each instance
        # compiles its own copy of the step (:func:`_private`), so another model in this process (a
        # second engine, a bench's stubbed projections) never meets these graphs.
        self._step = torch.compile(_private(decode_step.__wrapped__), dynamic=False,  # type: ignore[attr-defined]
                                   options={"size_asserts": False, "cpp_wrapper": True,
                                            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def warm(self) -> None:
        """Compile every width now (a step on the scratch block), logging each as it is done."""
        started = time.monotonic()
        for i, width in enumerate(self.widths, 1):
            t0 = time.monotonic()
            self._run(0, 0, SCRATCH * BLOCK_SIZE, [SCRATCH], width)
            log.info("compiled a decode graph", extra={"positions": width * BLOCK_SIZE, "graph": i,
                                                      "of": len(self.widths), "took_s": round(time.monotonic() - t0, 1),
                                                      "elapsed_s": round(time.monotonic() - started, 1)})

    def width_for(self, blocks: int) -> int | None:
        """The narrowest graph width holding ``blocks`` blocks; None when none does (decode eagerly)."""
        return next((w for w in self.widths if w >= blocks), None)

    def decode(self, token: int, position: int, slot: int, blocks: list[int]) -> Tensor | None:
        """Logits ``[1, V]`` of one row's step, or None when its table is wider than every graph."""
        width = self.width_for(position // BLOCK_SIZE + 1)
        if width is None:
            return None
        self.steps += 1
        return self._run(token, position, slot, blocks, width)

    def _run(self, token: int, position: int, slot: int, blocks: list[int], width: int) -> Tensor:
        # blocks past ``width`` hold no position this step attends (the mask would hide them)
        inputs = pad_rows([token], [position], [slot], [blocks[:width]], 1, width)  # table [1, width]
        with torch.no_grad():
            out: Tensor = self._step(self.model, self.cache, *inputs, kernels=False)
        return out
