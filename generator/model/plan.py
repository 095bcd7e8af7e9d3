"""The plan: a model's projections as the forward runs them (fused, and quantized when asked), the limits the
kernel table sets on it, and the decode attention backend chosen for the model when the plan is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..kernels.formats import Q4Weight
from .attention import FP32_ATTENTION_ROWS, DecodeAttention
from .layers import LayerPlan
from .quant import DENSE_ROWS, QuantLinear, QuantMode, quantize_weight
from .stack import LayerStack

__all__ = ["Plan", "build_plan", "plan_as_stored", "plan_for", "release_float_weights"]


@dataclass
class Plan:
    """The projections as the forward runs them: fused, and quantized when asked."""

    layers: list[LayerPlan]
    lm_head: nn.Module
    quant: QuantMode
    # how decode steps attend: chosen once for the model (generator.model.attention)
    attention: DecodeAttention
    # decode steps of at most this many rows read a 16-bit KV cache in fp32 (generator.model.kerneltable measures it)
    attention_fp32_rows: int = FP32_ATTENTION_ROWS
    # decode steps of at most this many rows take attention.c's kernel over the pool (0: the torch ops)
    paged_attention_rows: int = 0
    # the eager decode step's RMSNorm, RoPE with the cache write, and SiLU(gate) * up through the library's
    # ops (norm.c, pointwise.c; attention.c's cache write) where it is loaded
    step_ops: bool = False
    # with step_ops, the decoder layers of a step in one call where every projection runs the library's kernels
    # (generator/model/stack.py)
    stack: LayerStack | None = None

    def projections(self, role: str) -> list[nn.Module]:
        """The plan's modules of one role (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``)."""
        if role == "lm_head":
            return [self.lm_head]
        return [getattr(lp, role) for lp in self.layers]


_PLANS: WeakKeyDictionary[nn.Module, Plan] = WeakKeyDictionary()


def _fuse(mods: list[Any], quant: QuantMode, dense_rows: int = DENSE_ROWS,
          verdicts: dict[tuple[str, str, int, int], bool] | None = None) -> nn.Module:
    """One projection for ``mods`` stacked along the output. The originals become views into
    the fused float weight (no second copy; the model's own forward still works)."""
    weight = torch.cat([m.weight for m in mods])
    biases = [m.bias for m in mods]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("cannot fuse projections where only some have a bias")
    start = 0
    for m in mods:
        stop = start + m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return quantize_weight(weight, bias, quant, dense_rows, verdicts)


# Where each of a layer's projections comes from: its parent module and the Linears fused into it.
_SOURCES = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
            "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}


def _assemble(model: Any, part: Callable[[int, Any, str], nn.Module], quant: QuantMode, dense_rows: int,
              verdicts: dict[tuple[str, str, int, int], bool]) -> Plan:
    """The plan of ``model`` with each layer's projections from ``part(layer index, layer, role)``, its
    ``lm_head`` and decode attention backend; registered for :func:`plan_for`."""
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = (part(i, layer, role) for role in ("qkv", "o", "gate_up", "down"))
        layers.append(LayerPlan(qkv, o, gate_up, down, attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                                mlp.gate_proj.weight.shape[0]))
    lm_head = model.lm_head
    if quant != "none":
        # lm_head stays at 8 bits under int4, as in the GGUF the default model comes from (its output is
        # Q8_0, its layers Q4_1): 4 bits cost it far more accuracy than 8.
        lm_head = quantize_weight(model.lm_head.weight, model.lm_head.bias, "int8", dense_rows, verdicts)
    plan = Plan(layers, lm_head, quant, DecodeAttention(model))
    _PLANS[model] = plan
    return plan


def plan_as_stored(model: Any, stored: dict[str, Q4Weight], dense_rows: int = DENSE_ROWS) -> Plan:
    """The int4 plan of a model whose projections came as stored (:func:`generator.model.gguf.load_gguf_llama`
    with ``as_stored``): each fused projection is its parts' blocks stacked, nothing quantized; ``lm_head`` is
    int8 from its float weight, as :func:`build_plan` makes it."""
    def part(i: int, layer: Any, role: str) -> nn.Module:
        parent, names = _SOURCES[role]
        ws = [stored[f"model.layers.{i}.{parent}.{name}"] for name in names]
        return QuantLinear.from_q4(Q4Weight(torch.cat([w.nibbles for w in ws]), torch.cat([w.d for w in ws]),
                                            torch.cat([w.m for w in ws])), dense_rows)

    return _assemble(model, part, "int4", dense_rows, {})


def build_plan(model: Any, quant: QuantMode = "none", dense_rows: int = DENSE_ROWS) -> Plan:
    """Fuse (and quantize) the model's projections once, after it is on its device, and choose its decode
    attention backend.

    Quantized, the plan's projections hold the quantized weights and keep the float ones for
    many-row matmuls (a prefill: see :mod:`generator.model.quant`); ``lm_head`` is int8 (the
    embedding it may be tied to is untouched). The model's own modules and forward are unchanged.
    """
    verdicts: dict[tuple[str, str, int, int], bool] = {}  # each kernel checked once per shape

    def part(i: int, layer: Any, role: str) -> nn.Module:
        parent, names = _SOURCES[role]
        mods = [getattr(getattr(layer, parent), name) for name in names]
        if len(mods) > 1:
            return _fuse(mods, quant, dense_rows, verdicts)
        m = mods[0]
        return quantize_weight(m.weight, m.bias, quant, dense_rows, verdicts) if quant != "none" else m

    return _assemble(model, part, quant, dense_rows, verdicts)


def release_float_weights(model: Any, plan: Plan) -> int:
    """Let go of the float weights of the quantized decoder projections that the library can de-quantize for
    a call (``TOKENPIPE_FLOAT_WEIGHTS=drop``), and of the model's own references to them (left on the meta
    device: shaped, holding nothing, failing loudly if read); returns the bytes let go. The model's own forward
    no longer runs after this; the engine's does. ``lm_head`` keeps its float weight: it is the embedding."""
    freed = 0
    for layer, lp in zip(model.model.layers, plan.layers, strict=True):
        for role, (parent, names) in _SOURCES.items():
            mod = getattr(lp, role)
            dense = getattr(mod, "dense", None)
            if not isinstance(mod, QuantLinear) or dense is None or not mod.release_float():
                continue
            freed += dense.numel() * dense.element_size()
            owner = getattr(layer, parent)
            for name in names:
                linear = getattr(owner, name)
                linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=linear.weight.dtype,
                                                         device="meta"), requires_grad=False)
    return freed


def plan_for(model: Any) -> Plan:
    """The model's plan, built (fused, unquantized) on first use."""
    return _PLANS.get(model) or build_plan(model)
