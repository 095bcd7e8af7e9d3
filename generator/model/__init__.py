"""The model layer: loading a model (and preparing the default one), its plan (fused, quantized
projections and the decode attention backend), the forward pass over the paged KV cache's tensors,
and the kernel table measured at start-up. No scheduling, no transport: above it the engine decides
what runs when."""

from .forward import decode_step, prefill
from .kvcache import BLOCK_SIZE, PagedKVCache
from .loader import LoadedModel, load_for, load_model
from .plan import Plan, build_plan, plan_for

__all__ = ["BLOCK_SIZE", "LoadedModel", "PagedKVCache", "Plan", "build_plan", "decode_step", "load_for",
           "load_model", "plan_for", "prefill"]
