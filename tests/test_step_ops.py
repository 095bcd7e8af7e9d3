"""The step's other ops in the kernel library. Decode attention read straight from the paged KV pool
(generator/kernels/csrc/attention.c, the op ``tokenpipe.paged_attention``): the attention the torch ops give, in
fp32 and bf16, over block tables in any order, rows of any length, grouped KV heads; refused inputs
raise; one graph under torch.compile. RMSNorm (norm.c, ``rms_norm``): rounded as the torch code it
replaces; the cache write (attention.c, ``kv_write``): each row's heads at its slot, nothing else."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from generator.kernels.build import load_gemv
from generator.kernels.ops import GemvLib
from generator.model.forward import decode_step
from generator.model.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from generator.model.loader import load_model
from generator.model.plan import plan_for


@pytest.fixture(scope="module")
def lib(data_dir: Path) -> GemvLib:
    built = load_gemv(data_dir)
    assert built is not None, "these machines have AVX2, FMA and compilers: the kernels must build"
    return built


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """fp32 attention of ``q [B, H, hd]`` over positions 0..positions[b] of each row's blocks."""
    B, H, hd = q.shape
    G = k.shape[0]
    out = torch.empty(B, H, hd)
    for b in range(B):
        T = int(positions[b]) + 1
        kr, vr = (t[:, tables[b]].reshape(G, -1, hd)[:, :T].float() for t in (k, v))  # [G, T, hd]
        for h in range(H):
            g = h // (H // G)
            out[b, h] = (q[b, h].float() @ kr[g].T * scale).softmax(-1) @ vr[g]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "H", "G", "hd", "width"), [(1, 9, 3, 64, 8), (5, 9, 3, 64, 4), (3, 4, 4, 16, 2),
                                                        (33, 8, 2, 32, 3), (2, 14, 2, 40, 3)])
def test_the_kernel_gives_the_attention_of_each_rows_own_blocks(lib: GemvLib, dtype: torch.dtype, B: int, H: int,
                                                                 G: int, hd: int, width: int) -> None:
    """Tables are shuffled block ids (no row's blocks adjacent), lengths ragged, with a row ending on
    the first position of a block, one on the last, one attending only itself."""
    gen = torch.Generator().manual_seed(B * 100 + hd)
    blocks = 1 + B * width + 2
    k, v = (torch.randn(G, blocks, BLOCK_SIZE, hd, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(B, H, hd, generator=gen).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=gen)[:B * width] + 1).view(B, width)
    positions = torch.randint(0, width * BLOCK_SIZE, (B,), generator=gen)
    positions[0] = 0
    if B > 2:
        positions[1], positions[2] = BLOCK_SIZE, width * BLOCK_SIZE - 1
    got = torch.ops.tokenpipe.paged_attention(q, k, v, tables, positions, hd ** -0.5)
    assert got.shape == (B, H, hd) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert torch.allclose(got.float(), reference(q, k, v, tables, positions, hd ** -0.5), atol=tol)


def test_positions_past_the_table_and_mixed_dtypes_are_refused(lib: GemvLib) -> None:
    k = v = torch.zeros(1, 4, BLOCK_SIZE, 16)
    q, tables = torch.zeros(1, 2, 16), torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="beyond its table of 2 blocks"):
        torch.ops.tokenpipe.paged_attention(q, k, v, tables, torch.tensor([2 * BLOCK_SIZE]), 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.tokenpipe.paged_attention(q, k, v, torch.tensor([[1, 9]]), torch.tensor([BLOCK_SIZE]), 1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.tokenpipe.paged_attention(q.bfloat16(), k, v, tables, torch.tensor([3]), 1.0)


def test_decode_steps_through_the_kernels_match_the_torch_ops(lib: GemvLib, data_dir: Path) -> None:
    """The whole step, the library's ops (attention, the cache write, RMSNorm) against the torch ops, each
    on a pool filled the same way: the same logits (fp32 model), the same K/V written."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    plan = plan_for(lm.model)
    rows, context = 3, 40
    per_row = -(-(context + 1) // BLOCK_SIZE)
    cache = PagedKVCache(lm.model, (rows * per_row + 1) * BLOCK_SIZE * bytes_per_position(lm.model, lm.dtype),
                         lm.device, lm.dtype, min_positions=context + 1)
    tables = torch.arange(rows * per_row).flip(0).view(rows, per_row) + 1  # blocks in reverse order
    gen = torch.Generator().manual_seed(0)
    for pos in range(context):  # fill each row's cache one step at a time, through the torch ops
        positions = torch.full((rows,), pos)
        slots = tables[torch.arange(rows), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        decode_step(lm.model, cache, torch.randint(0, 100, (rows,), generator=gen), positions, slots, tables)
    positions = torch.tensor([context, context - 7, 5])  # rows of different lengths: the later slots are rewritten
    slots = tables[torch.arange(rows), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    tokens = torch.tensor([1, 2, 3])
    saved = plan.paged_attention_rows, plan.step_ops
    pool = [kv.clone() for kv in cache.kv]
    try:
        got, written = {}, {}
        for paged, ops in ((0, False), (rows, True)):
            for kv, before in zip(cache.kv, pool, strict=True):
                kv.copy_(before)
            plan.paged_attention_rows, plan.step_ops = paged, ops
            got[ops] = decode_step(lm.model, cache, tokens, positions, slots, tables)
            written[ops] = [kv.clone() for kv in cache.kv]
    finally:
        plan.paged_attention_rows, plan.step_ops = saved
    assert torch.allclose(got[True], got[False], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(written[True], written[False], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(written[True], pool, strict=True))  # this step wrote K/V


def test_the_kernel_compiles_into_one_graph(lib: GemvLib) -> None:
    """torch.compile keeps the op opaque: no graph break around it (fullgraph), the same result."""
    k = v = torch.randn(3, 4, BLOCK_SIZE, 64)

    def f(q: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.ops.tokenpipe.paged_attention(torch.relu(q), k, v, tables, positions, 0.125) * 2

    args = (torch.randn(1, 9, 64), torch.tensor([[2, 1]]), torch.tensor([20]))
    assert torch.equal(torch.compile(f, fullgraph=True, dynamic=False)(*args), f(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (40, 1, 24), (2, 1, 20)])
def test_the_norm_op_rounds_as_the_torch_code_it_replaces(lib: GemvLib, dtype: torch.dtype,
                                                          shape: tuple[int, ...]) -> None:
    """bf16: normalised in fp32, rounded, times the weight (rounded again), as ``_rms_norm``'s torch path;
    fp32: the fused ``rms_norm`` with its weight."""
    from generator.model.layers import rms_norm as _rms_norm

    gen = torch.Generator().manual_seed(shape[0])
    norm = types.SimpleNamespace(weight=(torch.rand(shape[-1], generator=gen) + 0.5).to(dtype), variance_epsilon=1e-5)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    got, ref = _rms_norm(norm, x, ops=True), _rms_norm(norm, x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    else:  # one bf16 step apart at most, where the two sums of squares round differently
        assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7
        assert (got == ref).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rotates_q_and_k_as_the_torch_ops_and_writes_k_v_at_the_slots(lib: GemvLib,
                                                                                 dtype: torch.dtype) -> None:
    """``rope_write`` against ``_rope`` on the fused projection's q and k (rounded as its two ops round) and
    the pool written as ``kv_write`` writes it; a slot outside the pool is refused."""
    from generator.model.layers import rope as _rope
    from generator.model.layers import rotary as _rotary

    B, H, G, hd, blocks = 3, 9, 3, 64, 4
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, (H + 2 * G) * hd, generator=gen).to(dtype)
    cos, sin = (torch.randn(B, 1, hd, generator=gen).to(dtype) for _ in range(2))
    rot = _rotary(cos, sin)
    kv = torch.zeros(2, G, blocks, BLOCK_SIZE, hd, dtype=dtype)
    slots = torch.tensor([5, 40, 17])
    q = lib_rope(qkv, rot, kv, slots, H)
    ref = _rope(qkv[:, :(H + G) * hd].view(B, 1, H + G, hd), rot)[:, 0]  # [B, H + G, hd]
    assert q.shape == (B, H, hd) and q.dtype == dtype and torch.equal(q, ref[:, :H])
    flat = kv.view(2, G, -1, hd)
    assert torch.equal(flat[0, :, slots].transpose(0, 1), ref[:, H:])
    assert torch.equal(flat[1, :, slots].transpose(0, 1), qkv[:, (H + G) * hd:].view(B, G, hd))
    assert int((flat != 0).any(-1).sum()) == 2 * B * G  # nothing else written
    with pytest.raises(RuntimeError, match="outside the pool"):
        lib_rope(qkv, rot, kv, torch.tensor([0, 1, blocks * BLOCK_SIZE]), H)


def lib_rope(qkv: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor, slots: torch.Tensor,
             heads: int) -> torch.Tensor:
    B, hd = qkv.shape[0], kv.shape[-1]
    out: torch.Tensor = torch.ops.tokenpipe.rope_write(qkv, rot[0].reshape(B, hd), rot[1].reshape(B, hd), kv, slots,
                                                       heads)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_activation_times_up_rounded_as_torch_rounds(lib: GemvLib, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(5, 1, 2 * 1536, generator=gen) * 4).to(dtype)
    gu[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # e^x's clamps: silu is -0, 200, 0, -0
    gate, up = gu.split([1536, 1536], dim=-1)
    got, ref = torch.ops.tokenpipe.silu_mul(gu), torch.nn.functional.silu(gate) * up
    assert got.shape == ref.shape and got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    else:  # the exp's last bit may round silu to the next bf16 now and then
        assert (got == ref).float().mean() > 0.99
        assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=1e-6)


def test_kv_write_puts_each_rows_heads_at_its_slot_and_refuses_slots_outside_the_pool(lib: GemvLib) -> None:
    kv = torch.zeros(2, 3, 4, BLOCK_SIZE, 8)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    torch.ops.tokenpipe.kv_write(kv, k, v, torch.tensor([5, 40]))
    flat = kv.view(2, 3, -1, 8)
    assert torch.equal(flat[0, :, 5], k[0]) and torch.equal(flat[1, :, 40], v[1])
    assert int((flat != 0).any(-1).sum()) == 2 * 2 * 3  # nothing else written
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.tokenpipe.kv_write(kv, k, v, torch.tensor([5, 4 * BLOCK_SIZE]))


def test_a_model_whose_heads_the_kernel_cannot_take_keeps_the_torch_ops() -> None:
    """Head sizes not a multiple of 8 would be refused by the op at the first decode step: such a model
    never gets the kernel in its table."""
    from generator.model.autotune import _kernel_attends

    def model(hidden: int, heads: int, kv_heads: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden, num_attention_heads=heads,
                                                                  num_key_value_heads=kv_heads))

    assert _kernel_attends(model(576, 9, 3))  # SmolLM2-135M: 64 a head
    assert not _kernel_attends(model(48, 4, 2))  # 12 a head
    assert not _kernel_attends(model(64, 4, 3))  # 4 query heads cannot share 3 kv heads evenly
