"""Weight-only quantization (generator.model.quant) on the tiny random model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from bench.kvstep import RawSteps
from generator.engine.handle import Emission, Job
from generator.engine.runner import Runner
from generator.engine.scheduler import Engine
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import plan_for
from generator.model.quant import BF16_DENSE_ROWS, DENSE_ROWS, QuantLinear, check_quant, dense_rows_for, resolve_quant
from tokenpipe.errors import InvalidRequest
from tokenpipe.settings import Settings
from tokenpipe.wire import Request, SamplingParams

# Relative error of the prompt's last logits against fp32, measured on tiny-random: int8 0.010,
# int4 0.124 (the tiny model's random weights are Gaussian: the worst case for 4 bits).
BOUND = {"int8": 0.03, "int4": 0.25}


def _last_logits(lm: LoadedModel, prompt: list[int]) -> torch.Tensor:
    return RawSteps(lm, 1, 256).prefill(torch.tensor([prompt]))[0].float()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_forward_is_close_to_fp32(tiny_model: LoadedModel, data_dir: Path, mode: str) -> None:
    quant = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant=mode)
    assert quant.quant == mode
    plan = plan_for(quant.model)
    assert isinstance(plan.layers[0].down, QuantLinear) and isinstance(plan.lm_head, QuantLinear)
    prompt = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    ref, got = _last_logits(tiny_model, prompt), _last_logits(quant, prompt)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < BOUND[mode], rel
    # the model's own modules keep the float weights: transformers' forward is unchanged
    with torch.inference_mode():
        hf = quant.model(torch.tensor([prompt])).logits[0, -1].float()
        hf_ref = tiny_model.model(torch.tensor([prompt])).logits[0, -1].float()
    assert torch.equal(hf, hf_ref)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_linear_matches_its_dequantized_weight(mode: str) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.02, torch.randn(3, 5, 128)
    lin = QuantLinear(w, None, mode)  # type: ignore[arg-type]
    y = lin(x)
    assert y.shape == (3, 5, 96) and y.dtype == torch.float32
    ref = x @ w.T
    assert ((y - ref).norm() / ref.norm()).item() < BOUND[mode]
    # a matmul of many rows (a prefill) runs on the float weight
    many = torch.randn(DENSE_ROWS + 1, 128)
    assert torch.equal(lin(many), torch.nn.functional.linear(many, w))


def test_quantized_engine_streams(data_dir: Path) -> None:
    """A Runner over an int4 engine streams each request to its length, one token per step,
    and a request's greedy tokens are the ones it gets alone."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    got: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    all_done = threading.Event()

    def on_emit(batch: list[Emission]) -> None:
        for e in batch:
            assert len(e.token_ids) <= 1
            got.setdefault(e.request_id, []).extend(e.token_ids)
            if e.finish is not None:
                finishes[e.request_id] = e.finish
        if len(finishes) == 3:
            all_done.set()

    runner = Runner(lm, on_emit, max_batch=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [Request.create("tiny-random", prompt=f"stream {i} please", params=params) for i in range(3)]
    runner.start()
    try:
        for req in requests:
            runner.submit(Job(req))
        assert all_done.wait(120), "the quantized engine did not finish"
    finally:
        runner.stop()
    assert set(finishes.values()) == {"length"}
    engine = Engine(lm, max_batch=1)
    for req in requests:
        assert req.prompt is not None
        seq = engine.new_sequence(req.id, lm.tokenizer.encode(req.prompt), params)
        engine.add(seq)
        engine.run_to_completion()
        assert got[req.id] == seq.generated


def test_invalid_quant_is_a_clear_error(data_dir: Path) -> None:
    with pytest.raises(InvalidRequest, match="unknown quant 'int3'; use auto, none, int8, int4"):
        load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int3")
    with pytest.raises(InvalidRequest, match="unknown quant"):
        check_quant("fp8")
    assert Settings.load(env={"TOKENPIPE_QUANT": "int8"}).quant == "int8"


def test_auto_quant_is_int4_for_4bit_weights_on_a_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quant("auto", from_4bit=True, device=cpu, native_bf16=False) == "int4"
    assert resolve_quant("auto", from_4bit=True, device=cpu, native_bf16=True) == "int4"
    assert resolve_quant("auto", from_4bit=False, device=cpu, native_bf16=False) == "none"
    assert resolve_quant("auto", from_4bit=True, device=cuda, native_bf16=False) == "none"
    assert resolve_quant("int8", from_4bit=False, device=cpu, native_bf16=True) == "int8"
    assert Settings.load(env={}).quant == "auto"


def test_a_kernel_that_fails_its_check_leaves_the_float_weight_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard for devices without a working kernel (a GPU path untested here)."""
    def broken(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(QuantLinear, "_kernel", broken)
    w, x = torch.randn(64, 64) * 0.02, torch.randn(2, 64)
    lin = QuantLinear(w, None, "int4")
    assert lin.fallback
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w))


def test_with_native_bf16_the_bf16_weight_serves_more_than_16_rows() -> None:
    """Where bf16 is native the bf16 GEMM beats the int4 kernel from about 20 rows on (bench in
    generator.model.quant), so a bf16 model hands matmuls of more than 16 rows to its float weight."""
    assert dense_rows_for(torch.bfloat16, native_bf16=True) == BF16_DENSE_ROWS == 16
    assert dense_rows_for(torch.bfloat16, native_bf16=False) == DENSE_ROWS
    assert dense_rows_for(torch.float32, native_bf16=True) == DENSE_ROWS
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    q = QuantLinear(w, None, "int8", dense_rows=BF16_DENSE_ROWS)  # the routing is the same for int4
    few, many = torch.randn(BF16_DENSE_ROWS, 128, dtype=torch.bfloat16), torch.randn(BF16_DENSE_ROWS + 1, 128,
                                                                                       dtype=torch.bfloat16)
    assert torch.equal(q(many), torch.nn.functional.linear(many, w))  # the float weight, exactly
    ref = few.float() @ q.dequantize().T
    assert ((q(few).float() - ref).norm() <= 0.02 * ref.norm()).item()  # the quantized kernel
    assert not torch.equal(q(few), torch.nn.functional.linear(few, w))


def test_each_kernel_is_checked_once_per_shape_not_once_per_layer(data_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (start-up time): every quantized projection de-quantized its weight to check the kernel, 121
    times for SmolLM2's 30 layers; a kernel that works for one layer of a shape works for all of them."""
    checked: list[tuple[str, int, int]] = []
    original = QuantLinear._kernel_ok

    def counting(self: QuantLinear, w: torch.Tensor) -> bool:
        checked.append((self.mode, self.out_features, self.in_features))
        return original(self, w)

    monkeypatch.setattr(QuantLinear, "_kernel_ok", counting)
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    plan = plan_for(lm.model)
    mods = [m for role in ("qkv", "o", "gate_up", "down", "lm_head") for m in plan.projections(role)]
    assert len(mods) == 9 and all(isinstance(m, QuantLinear) and not m.fallback for m in mods)
    shapes = {(m.mode, m.out_features, m.in_features) for m in mods if isinstance(m, QuantLinear)}
    assert sorted(checked) == sorted(shapes)  # one check per distinct shape, each verdict applied to all
