"""``TOKENPIPE_FLOAT_WEIGHTS=drop``: the quantized projections without their float copies
(:func:`generator.model.plan.release_float_weights`), on the tiny random model with tokenpipe's kernels."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from generator.engine.scheduler import Engine
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear
from tokenpipe.settings import Settings
from tokenpipe.wire import SamplingParams


def _load(data_dir: Path, float_weights: str) -> LoadedModel:
    # one kernel for every decode row count, so both loads decode alike whatever a measurement would say
    return load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4",
                      kernels="gemm8", float_weights=float_weights)


def _projections(lm: LoadedModel) -> list[QuantLinear]:
    mods = [m for lp in plan_for(lm.model).layers for m in (lp.qkv, lp.o, lp.gate_up, lp.down)]
    assert all(isinstance(m, QuantLinear) for m in mods)
    return [m for m in mods if isinstance(m, QuantLinear)]


def _greedy(lm: LoadedModel, prompt: list[int]) -> list[int]:
    engine = Engine(lm, max_batch=1)
    seq = engine.new_sequence("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add(seq)
    engine.run_to_completion()
    return seq.generated


def test_dropped_float_weights_leave_no_copy_and_the_model_shaped(data_dir: Path) -> None:
    lean = _load(data_dir, "drop")
    assert all(m.dense is None and m.packed is None for m in _projections(lean))
    for layer in lean.model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                     layer.mlp.down_proj):
            assert proj.weight.is_meta and proj.weight.dim() == 2  # shaped, holding nothing
    assert not lean.model.model.embed_tokens.weight.is_meta  # the embedding (lm_head's float weight) stays
    kept = _load(data_dir, "keep")
    assert all(m.dense is not None for m in _projections(kept))
    assert not kept.model.model.layers[0].self_attn.q_proj.weight.is_meta


def test_without_float_weights_a_prefill_gives_the_tokens_of_the_dequantized_weights(data_dir: Path) -> None:
    """A prompt of more rows than the table's quantized bands makes each float weight for the call: its greedy
    tokens are those of a model that keeps, as its float weights, the quantized ones de-quantized."""
    lean, ref = _load(data_dir, "drop"), _load(data_dir, "keep")
    for r, q in zip(_projections(ref), _projections(lean), strict=True):
        assert q.gemv is not None and q.gemv_lib is not None
        r.dense = q.gemv_lib.dequantize(q.gemv, torch.float32)
    for length in (37, 100):
        prompt = [(13 * i) % 500 + 3 for i in range(length)]
        assert _greedy(lean, prompt) == _greedy(ref, prompt)


def test_without_its_float_weight_a_dense_band_multiplies_the_dequantized_weight(data_dir: Path) -> None:
    """Regression: rows beyond the quantized bands ran gemm8 (int8 rows) where the float weight was let go:
    `make up`'s SmolLM2 (bf16, the measured table) answered "What is the capital of France?" with "L'Étoile,
    la Marseillaise, ..." from its 37-token prefill. They multiply the weight de-quantized for the call."""
    mod = _projections(_load(data_dir, "drop"))[0]
    assert mod.gemv is not None and mod.gemv_lib is not None
    for rows in (17, 37, 100):
        x = torch.randn(rows, mod.in_features)
        assert torch.equal(mod.run(x, "dense"), F.linear(x, mod.gemv_lib.dequantize(mod.gemv, torch.float32)))


def test_float_weights_are_dropped_by_default() -> None:
    assert Settings.load(env={}).float_weights == "drop"
