"""The model layer: loading a model (and preparing the default one), its plan (fused, quantized
projections and the decode attention backend), the forward pass over the paged KV cache's tensors,
and the kernel table measured at start-up. No scheduling, no transport: above it the engine decides
what runs when."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .forward import decode_step, prefill
    from .kvcache import BLOCK_SIZE, PagedKVCache
    from .loader import LoadedModel, load_for, load_model
    from .plan import Plan, build_plan, plan_for

__all__ = ["BLOCK_SIZE", "LoadedModel", "PagedKVCache", "Plan", "build_plan", "decode_step", "load_for",
           "load_model", "plan_for", "prefill"]

# Each name from its module on first use (see generator/__init__.py: preparation without torch)
_HOMES = {"decode_step": ".forward", "prefill": ".forward", "BLOCK_SIZE": ".kvcache", "PagedKVCache": ".kvcache",
          "LoadedModel": ".loader", "load_for": ".loader", "load_model": ".loader", "Plan": ".plan",
          "build_plan": ".plan", "plan_for": ".plan"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
