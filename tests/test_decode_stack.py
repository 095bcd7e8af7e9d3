"""The decoder layers of an eager decode step in one call (generator/stack.py, ``tokenpipe.DecodeStack``): the
same C functions in the same order as the op-by-op step, so the same logits and the same K/V to the bit, on
every kernel a projection can run, in fp32 and bf16; what it cannot take goes op by op; bad input raises."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from generator.kernels.build import load_gemv
from generator.kernels.ops import GemvLib
from generator.model.autotune import apply_table
from generator.model.forward import decode_step
from generator.model.kerneltable import row_counts, rule_table
from generator.model.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear
from generator.model.stack import ROLES, LayerStack


@pytest.fixture(scope="module")
def lib(data_dir: Path) -> GemvLib:
    built = load_gemv(data_dir)
    assert built is not None, "these machines have AVX2, FMA and compilers: the kernels must build"
    return built


def _filled(lm: LoadedModel, rows: int, context: int) -> tuple[PagedKVCache, torch.Tensor]:
    """A pool with ``context`` positions of each row written (blocks in reverse order), and the tables."""
    per_row = -(-(context + 1) // BLOCK_SIZE)
    cache = PagedKVCache(lm.model, (rows * per_row + 1) * BLOCK_SIZE * bytes_per_position(lm.model, lm.dtype),
                         lm.device, lm.dtype, min_positions=context + 1)
    tables = torch.arange(rows * per_row).flip(0).view(rows, per_row) + 1
    gen = torch.Generator().manual_seed(0)
    for pos in range(context):
        slots = tables[torch.arange(rows), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        decode_step(lm.model, cache, torch.randint(0, 100, (rows,), generator=gen), torch.full((rows,), pos), slots,
                    tables)
    return cache, tables


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["gemv", "gemm8", "amx"])
def test_a_step_through_the_stack_equals_the_op_by_op_step_to_the_bit(lib: GemvLib, data_dir: Path, dtype: str,
                                                                      kernel: str) -> None:
    lm = load_model("tiny-random", device="cpu", dtype=dtype, data_dir=data_dir, quant="int4", kernels=kernel)
    plan = plan_for(lm.model)
    stack = plan.stack
    assert isinstance(stack, LayerStack)
    rows, context = 3, 37
    cache, tables = _filled(lm, rows, context)
    positions = torch.tensor([context, context - 9, 4])  # ragged rows: the later slots are written again
    slots = tables[torch.arange(rows), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    tokens = torch.tensor([5, 6, 7])
    assert stack.kernels(rows) is not None  # this step takes the stack
    pool = [kv.clone() for kv in cache.kv]
    got, written = {}, {}
    try:
        for through in (None, stack):
            for kv, before in zip(cache.kv, pool, strict=True):
                kv.copy_(before)
            plan.stack = through
            got[through is not None] = decode_step(lm.model, cache, tokens, positions, slots, tables)
            written[through is not None] = [kv.clone() for kv in cache.kv]
        stack.projections_off = True  # the step did go through the stack: without its projections it differs
        for kv, before in zip(cache.kv, pool, strict=True):
            kv.copy_(before)
        off = decode_step(lm.model, cache, tokens, positions, slots, tables)
    finally:
        plan.stack = stack
        stack.projections_off = False
    assert not torch.equal(off, got[True])
    assert got[True].dtype == lm.dtype and torch.equal(got[True], got[False])
    assert all(torch.equal(a, b) for a, b in zip(written[True], written[False], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(written[True], pool, strict=True))  # this step wrote K/V


def test_a_role_on_a_torch_kernel_sends_the_step_op_by_op(lib: GemvLib, data_dir: Path) -> None:
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="gemv")
    plan = plan_for(lm.model)
    assert plan.stack is not None and plan.stack.kernels(1) == [0] * len(ROLES)
    for mod in plan.projections("down"):
        assert isinstance(mod, QuantLinear)
        mod.bands = ((1, "gemv"), (32, "quant"))
    assert plan.stack.kernels(1) == [0] * len(ROLES) and plan.stack.kernels(2) is None


def test_unquantized_models_have_no_stack(lib: GemvLib, data_dir: Path) -> None:
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="none")
    assert plan_for(lm.model).stack is None


def test_bad_input_is_refused_with_the_reason(lib: GemvLib, data_dir: Path) -> None:
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="gemv")
    stack = plan_for(lm.model).stack
    assert stack is not None
    cache, tables = _filled(lm, 1, 3)
    D, hd = lm.model.config.hidden_size, cache.head_dim
    x, rot = torch.zeros(1, D), torch.zeros(1, hd)
    codes = stack.kernels(1)
    assert codes is not None
    slot, pos = tables[:, :1] * BLOCK_SIZE + 3, torch.tensor([3])
    with pytest.raises(RuntimeError, match="beyond its table"):
        stack.step(x, rot, rot, cache.kv, slot[0], tables, torch.tensor([tables.shape[1] * BLOCK_SIZE]), codes)
    with pytest.raises(RuntimeError, match="outside the pool"):
        stack.step(x, rot, rot, cache.kv, torch.tensor([10**6]), tables, pos, codes)
    with pytest.raises(RuntimeError, match="x \\[B, 64\\]"):
        stack.step(x.bfloat16(), rot, rot, cache.kv, slot[0], tables, pos, codes)
    with pytest.raises(RuntimeError, match="one pool per layer"):
        stack.step(x, rot, rot, cache.kv[:1], slot[0], tables, pos, codes)
    with pytest.raises(RuntimeError, match="not built"):
        stack.step(x, rot, rot, cache.kv, slot[0], tables, pos, [1] * len(ROLES))  # gemm8's layout not made


def test_a_gemm8_copy_the_table_drops_is_freed_with_the_stack_holding_it_no_more(lib: GemvLib,
                                                                                  data_dir: Path) -> None:
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="gemm8")
    plan = plan_for(lm.model)
    assert plan.stack is not None and plan.stack.kernels(1) == [1] * len(ROLES)
    down = plan.projections("down")[0]
    assert isinstance(down, QuantLinear) and down.blocked is not None
    blocked = down.blocked
    copy = weakref.ref(blocked.w)
    del blocked
    counts = row_counts(4)
    apply_table(plan, rule_table(counts, 32, quantized=True, attention_fp32_rows=0, forced="gemv",
                                 paged_attention_rows=max(counts)))
    gc.collect()
    assert copy() is None  # neither the module nor the stack holds it
    assert plan.stack.kernels(1) == [0] * len(ROLES)
