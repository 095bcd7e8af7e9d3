"""SmolLM2 read from its GGUF file tensor by tensor (generator/model/gguf.py), and the memory the quantized
projections give back (issue 49)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from generator.model.loader import load_model
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear


@pytest.mark.smollm2
def test_weights_read_from_the_gguf_equal_the_fp32_conversion_bit_for_bit(data_dir: Path) -> None:
    """The generator no longer converts the GGUF to fp32 safetensors; what it reads must be what that held."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from generator.model.gguf import load_gguf_llama
    from generator.model.preparation import gguf_path

    converted = data_dir / "models" / "smollm2-135m"  # the whole conversion (tokenpipe prepare), made by conftest
    ref = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).state_dict()
    got = load_gguf_llama(gguf_path(), AutoConfig.from_pretrained(converted), torch.float32).state_dict()
    assert set(got) == set(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_a_table_without_torchs_kernel_frees_its_copy_and_keeps_the_tokens(data_dir: Path) -> None:
    """Regression (idle RSS): torch's packed int4 copy stayed beside the library's own where no band ran it."""
    gemv = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="gemv")
    mods = [m for role in ("qkv", "o", "gate_up", "down") for m in plan_for(gemv.model).projections(role)]
    first = mods[0]
    assert isinstance(first, QuantLinear)
    if first.gemv_lib is None:
        pytest.skip("tokenpipe's kernels are not built here")
    assert all(isinstance(m, QuantLinear) and m.qweight is None and m.scales is None for m in mods)
    x = torch.randn(3, first.in_features)
    assert torch.equal(first.run(x, "quant"), first.run(x, "gemv"))  # a band naming quant gets gemv
    rules = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="rules")
    kept = plan_for(rules.model).projections("qkv")[0]
    assert isinstance(kept, QuantLinear) and kept.qweight is not None  # rules run torch's kernel: kept
