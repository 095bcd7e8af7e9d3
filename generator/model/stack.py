"""The eager decode step's decoder layers in one call: ``tokenpipe.DecodeStack`` (kernels/csrc/stack_op.cpp).

Op by op, a layer of a one-row step is ~13 calls from Python (two RMSNorms, four projection modules, RoPE with
the cache write, attention over the pool, SiLU(gate) * up, two residual adds), each paying its dispatch, its
output's allocation and the views around it: measured on a 2-core AMX Xeon, about three quarters of what a
layer costs beside its projections' arithmetic. The stack calls the
same C functions in the same order, so a step's results are the same to the bit. It serves the steps whose
every layer projection runs one of the library's kernels (``gemv``, ``gemm8``, ``amx``) at the step's row
count; the op-by-op step serves the others, and every step of a model it cannot take (biases, Qwen3's
per-head norms, an activation other than SiLU, unquantized weights).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from ..kernels.formats import BlockedWeight, Q4Weight
from .kerneltable import kernel_for
from .layers import LayerPlan
from .quant import QuantLinear

__all__ = ["ROLES", "STACK_KERNELS", "LayerStack", "build_stack"]

log = logging.getLogger(__name__)

ROLES = ("qkv", "o", "gate_up", "down")  # stack_op.cpp's order
KERNEL_CODES = {"none": -1, "gemv": 0, "gemm8": 1, "amx": 2}  # stack_op.cpp's Kernel
STACK_KERNELS = ("gemv", "gemm8", "amx")  # the projection kernels a step through the stack can run


class StackPlan(Protocol):
    """What the stack reads of a model's plan (:class:`generator.model.plan.Plan`, which holds the stack)."""

    layers: list[LayerPlan]

    def projections(self, role: str) -> list[nn.Module]: ...


class LayerStack:
    """One model's decoder layers as the library's ``DecodeStack``. gemm8's layout of a role's weights is
    made (:meth:`QuantLinear.block`) and added the first time a step's row count needs it."""

    def __init__(self, model: Any, plan: StackPlan) -> None:
        self._model, self._plan = model, plan
        self.dtype: torch.dtype = model.model.layers[0].input_layernorm.weight.dtype
        self._blocked: dict[str, bool] = {}
        self._layouts: list[BlockedWeight | None] = []  # each module's gemm8 copy the script holds
        self._script: Any = None
        self.refresh()
        # bench/stepsplit.py's steps without projections: every projection writes zeros
        self.projections_off = False

    def refresh(self) -> None:
        """Take the projections' layouts as they are now (after generator.model.autotune.apply_table made or
        dropped gemm8's copies: a dropped copy is freed only once the stack lets go of it too). Rebuilding
        costs ~1 ms; the kernel table's timed steps apply a table before each step, so an unchanged
        plan is not rebuilt."""
        layouts = [m.blocked for role in ROLES for m in self._modules(role)]
        if self._script is not None and all(a is b for a, b in zip(layouts, self._layouts, strict=True)):
            return
        self._layouts = layouts
        self._blocked = {role: all(m.blocked is not None for m in self._modules(role)) for role in ROLES}
        self._script = self._build()

    def _modules(self, role: str) -> list[QuantLinear]:
        return cast(list[QuantLinear], self._plan.projections(role))  # build_stack checked them

    def _build(self) -> Any:
        layers, attn = self._model.model.layers, self._model.model.layers[0].self_attn
        cfg = self._model.config
        hd = int(attn.head_dim)
        script = torch.classes.tokenpipe.DecodeStack(int(cfg.num_attention_heads), int(cfg.num_key_value_heads), hd,
                                                     float(layers[0].input_layernorm.variance_epsilon),
                                                     float(attn.scaling))
        empty = torch.empty(0)
        mods = zip(*(self._modules(role) for role in ROLES), strict=True)  # per layer: qkv, o, gate_up, down
        for layer, projections in zip(layers, mods, strict=True):
            weights = []
            for mod in projections:
                g, b = mod.gemv, mod.blocked
                assert g is not None  # build_stack checked
                gemv = [g.nibbles, g.d, g.m] if isinstance(g, Q4Weight) else [g.q, g.s, empty]
                weights.append(gemv + ([b.w, b.d, b.m] if b is not None else [empty] * 3))
            script.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *weights)
        return script

    def kernels(self, rows: int) -> list[int] | None:
        """Each role's kernel code at ``rows`` rows (a role's modules share one band table), or None where a
        role's kernel is not the library's."""
        if self.projections_off:
            return [KERNEL_CODES["none"]] * len(ROLES)
        codes = []
        for role in ROLES:
            mods = self._modules(role)
            code = KERNEL_CODES.get(kernel_for(mods[0].bands, rows), -2)
            if code < 0:
                return None
            if code > 0 and not self._blocked[role]:
                if not all(m.block() for m in mods):
                    return None
                self.refresh()
            codes.append(code)
        return codes

    def step(self, x: Tensor, cos: Tensor, ssin: Tensor, kv: list[Tensor], slots: Tensor, tables: Tensor,
             positions: Tensor, kernels: list[int]) -> Tensor:
        """``x [B, D]`` through every layer (see :func:`generator.model.forward.decode_step`); ``kernels`` from
        :meth:`kernels`."""
        out: Tensor = self._script.step(x, cos, ssin, kv, slots, tables, positions, kernels)
        return out


def build_stack(model: Any, plan: StackPlan) -> LayerStack | None:
    """The stack for ``model``'s plan, or None (logged) where the library or the model cannot take it."""
    why = _unfit(model, plan)
    if why:
        log.info("decode steps run op by op: %s", why)
        return None
    return LayerStack(model, plan)


def _unfit(model: Any, plan: StackPlan) -> str:
    try:
        torch.classes.tokenpipe.DecodeStack  # noqa: B018 - a class is looked up lazily
    except (AttributeError, RuntimeError):
        return "the kernel library is not loaded"
    layers = model.model.layers
    if str(getattr(model.config, "hidden_act", "")) not in ("silu", "swish"):
        return "the MLP's activation is not SiLU"
    attn = layers[0].self_attn
    if hasattr(attn, "q_norm") or int(getattr(attn, "head_dim", 0)) % 16:
        return "per-head q/k norms or a head size that is not a multiple of 16"
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(getattr(n, "variance_epsilon", None) != norms[0].variance_epsilon or n.weight.dtype not in
           (torch.float32, torch.bfloat16) for n in norms):
        return "RMSNorms of different epsilons or dtypes"
    if any(layer.self_attn.scaling != attn.scaling for layer in layers):
        return "layers of different attention scales"
    if plan.layers[0].inter % 8:
        return "an MLP width that is not a multiple of 8"
    for role in ROLES:
        for mod in plan.projections(role):
            if not isinstance(mod, QuantLinear) or mod.gemv is None or mod.gemv_lib is None or mod.bias is not None:
                return f"a {role} projection the library's kernels cannot run"
    return ""
