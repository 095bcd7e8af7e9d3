"""tokenpipe's own AVX2 (and AVX-512) kernel for quantized projections (generator/kernels/csrc/gemv.c):
exact enough to be fp32, a candidate of the measured kernel table, opaque under torch.compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bench.ascpu import unavailable
from generator.engine.scheduler import Engine
from generator.kernels.build import AMX_FLAGS, AVX512_FLAGS, FLAGS, VNNI_FLAGS, build_flags, load_gemv
from generator.kernels.cpu import cpu_info
from generator.kernels.formats import Q4Weight, Q8Weight, block_q4, block_q8, pack_q4, pack_q8
from generator.kernels.ops import GemvLib
from generator.model.autotune import tune_plan
from generator.model.kerneltable import ROLES
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import build_plan, plan_for
from generator.model.quant import QuantLinear, _quant_int4, _quant_int8
from tests.conftest import run_bench
from tests.test_engine import GREEDY, TEXTS, hf_greedy, prompts_of, run_all


@pytest.fixture(scope="module")
def gemv(data_dir: Path) -> GemvLib:
    lib = load_gemv(data_dir)
    assert lib is not None, "these machines have AVX2, FMA and compilers: the kernel must build"
    return lib


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int4_kernel_is_the_dequantized_weights_product_at_every_tile_shape(gemv: GemvLib, rows: int) -> None:
    """Rows go in tiles of 4 (then 1-3); 37 outputs split unevenly over the threads."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (37, 96), generator=gen)
    scale, zero = torch.rand(37, 3, generator=gen) * 0.1, torch.randn(37, 3, generator=gen) * 0.1
    w = pack_q4(q, scale, zero)
    ref_w = ((q.float().view(37, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(37, 96)
    assert torch.allclose(w.dequantize(), ref_w, atol=1e-6)
    x = torch.randn(rows, 96, generator=gen)
    got = gemv.run(x, w)
    assert got.shape == (rows, 37) and got.dtype == torch.float32
    assert _rel_err(got, x @ ref_w.T) < 2e-4


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_int8_kernel_is_the_dequantized_weights_product(gemv: GemvLib, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (53, 64), generator=gen, dtype=torch.int8)
    s = torch.rand(53, generator=gen) * 0.01
    x = torch.randn(rows, 64, generator=gen)
    assert _rel_err(gemv.run(x, pack_q8(q, s)), x @ (q.float() * s[:, None]).T) < 2e-4


@pytest.mark.parametrize("groups", [67, 18, 8, 4, 1])
def test_one_row_kernels_hold_every_count_of_groups_and_rows(gemv: GemvLib, groups: int) -> None:
    """One row runs its own loop, four rows of W a step: 19 outputs end on a step of three rows. Its
    offset terms take 8 (AVX2) or 16 (AVX-512) groups at a time, the last ones under a mask: 67 and 18
    (SmolLM2's 576 inputs) end on a partial one. On AVX-512 the int4 loop takes 4 groups a step, the
    last step masked: 67 ends on three groups, 18 on two, 1 on one, 8 and 4 on none. Each must give
    the product as the tiles do, for int4 and int8."""
    gen = torch.Generator().manual_seed(groups)
    K = groups * 32
    q = torch.randint(0, 16, (19, K), generator=gen)
    scale, zero = torch.rand(19, groups, generator=gen) * 0.1, torch.randn(19, groups, generator=gen) * 0.1
    w4 = pack_q4(q, scale, zero)
    q8, s8 = torch.randint(-127, 128, (19, K), generator=gen, dtype=torch.int8), torch.rand(19, generator=gen) * 0.01
    x = torch.randn(2, K, generator=gen)
    for w, dense in ((w4, w4.dequantize()), (pack_q8(q8, s8), q8.float() * s8[:, None])):
        ref = x[:1] @ dense.T
        one, tiled = gemv.run(x[:1], w), gemv.run(x, w)[:1]  # the one-row loop; a tile of two rows
        assert _rel_err(one, ref) < 2e-4 and _rel_err(tiled, ref) < 2e-4


# torch.compile's own C++ is wrong under ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX-512 (docs/perf-history.md),
# a path no AVX2-only CPU takes: those two tests are left to the real CPU's run.
_AVX2_ONLY_RUN = "not into_one_graph and not as_on_an_avx2_only_cpu"


def test_the_kernel_tests_pass_as_on_an_avx2_only_cpu() -> None:
    """Where the CPU has AVX-512 the suite runs the library's AVX-512 loops, so the kernel, stack and step-op
    tests run again as on an AVX2-only CPU, under `bench.ascpu avx2`: the AVX2 build (its int4 one-row loop
    takes two groups a step, an odd last group alone; `gemm8` without VNNI), fp32 activations, torch's
    AVX2 kernels; every test run, none failed or skipped. Where the wrapper cannot hide flags (no root, no
    mount namespace) it refuses with the reason and runs nothing. On an AVX2-only CPU the suite's own run is
    that run already: skipped, saying so (it took ~40 s of the suite's 10 minutes)."""
    info = cpu_info()
    if info is not None and build_flags(info[1]) == FLAGS:
        pytest.skip("this CPU is AVX2-only: the suite's own kernel, stack and step-op tests are that run")
    proc = run_bench(["bench.ascpu", "avx2", "--", sys.executable, "-m", "pytest", "-q", "-n", "0",
                      "-p", "no:cacheprovider", "-k", _AVX2_ONLY_RUN, "tests/test_gemv.py",
                      "tests/test_decode_stack.py", "tests/test_step_ops.py"], timeout=600)
    reason = unavailable()
    if reason is not None:
        assert proc.returncode == 2 and reason in proc.stderr and proc.stdout == ""
        return
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "passed" in summary and "skipped" not in summary, proc.stdout[-3000:]


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_bf16_rows_go_in_and_come_out_as_bf16_without_a_float_copy(gemv: GemvLib, rows: int) -> None:
    """A bf16 model's activations are read and written by the kernel as they are: the product of the
    bf16 values, rounded once to bf16 (one bf16 step of error at most), for int4 and int8."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (37, 576), generator=gen)
    scale, zero = torch.rand(37, 18, generator=gen) * 0.1, torch.randn(37, 18, generator=gen) * 0.1
    w4 = pack_q4(q, scale, zero)
    q8, s8 = torch.randint(-127, 128, (37, 576), generator=gen, dtype=torch.int8), torch.rand(37, generator=gen) * 0.01
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    for w, dense in ((w4, w4.dequantize()), (pack_q8(q8, s8), q8.float() * s8[:, None])):
        got, ref = gemv.run(x, w), x.float() @ dense.T
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
        assert torch.allclose(got.float(), ref, rtol=2 ** -8, atol=1e-3)
        assert _rel_err(got, ref) < 4e-3


def _int8_rows(x: torch.Tensor, levels: int) -> torch.Tensor:
    """``x`` as gemm8.c takes it: rounded per group of 32 to ``levels`` steps each side of zero."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    # as the kernel: times levels / amax (a tensor division: ``int / tensor`` rounds another way), nearest even
    q = torch.round(g * (torch.full_like(amax, levels) / amax))
    return (q * (amax / levels)).view_as(x.float())


def _gemm8_case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, Q4Weight, Q8Weight]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    g = k // 32
    w4 = pack_q4(q, torch.rand(n, g, generator=gen) * 0.1, torch.randn(n, g, generator=gen) * 0.1)
    w8 = pack_q8(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) * 0.01)
    return torch.randn(rows, k, generator=gen), w4, w8


@pytest.mark.parametrize(("rows", "n"), [(1, 37), (2, 16), (3, 40), (8, 8), (9, 37), (17, 64)])
def test_gemm8_is_the_product_with_rows_rounded_to_int8(gemv: GemvLib, rows: int, n: int) -> None:
    """gemm8 equals the dequantized weight times x rounded to int8 per group of 32 (to fp32 rounding), for
    int4 and int8 weights: rows in tiles of 8 then the rest, output features in blocks of the build's lanes
    (16 or 8; 37 and 40 end on a padded block). The int8 weights' rows take 64 levels where the AVX2 sums
    would saturate (gemm8.c)."""
    x, w4, w8 = _gemm8_case(rows, n, 96, rows * 100 + n)
    lanes = gemv.lanes()
    assert lanes in (8, 16)
    for blocked, dense, levels in ((block_q4(w4, lanes), w4.dequantize(), 127),
                                   (block_q8(w8, lanes), w8.q.float() * w8.s[:, None], 64 if lanes == 8 else 127)):
        got = gemv.run(x, blocked)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert _rel_err(got, _int8_rows(x, levels) @ dense.T) < 1e-5
        assert 1e-4 < _rel_err(got, x @ dense.T) < 2e-2  # int8 rows: coarser than gemv's int16 ones, as llama.cpp's


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33])
def test_gemm8_on_amx_tiles_gives_the_loops_results_where_the_cpu_has_them(gemv: GemvLib, rows: int) -> None:
    """``tiles=True`` runs on AMX exactly where the CPU lists it (and VNNI), else the loop; either way the very
    same numbers (int32 sums per group, scaled in the same order): rows in tiles of 16, the last padded."""
    info = cpu_info()
    assert info is not None
    assert gemv.tiles() == ({"avx512bw", "avx512_vnni", "amx_tile", "amx_int8"} <= set(info[1]))
    x, w4, w8 = _gemm8_case(rows, 37, 96, rows + 5)
    for blocked in (block_q4(w4, gemv.lanes()), block_q8(w8, gemv.lanes())):
        for xx in (x, x.bfloat16()):
            assert torch.equal(gemv.run(xx, blocked, tiles=True), gemv.run(xx, blocked))


def test_gemm8_reads_and_writes_bf16_rows(gemv: GemvLib) -> None:
    x, w4, _ = _gemm8_case(5, 37, 576, 7)
    xb = x.bfloat16()
    got = gemv.run(xb, block_q4(w4, gemv.lanes()))
    ref = _int8_rows(xb, 127) @ w4.dequantize().T
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), ref, rtol=2 ** -8, atol=1e-3)


def test_gemm8_is_a_kernel_of_quantlinear_and_falls_back_without_the_library(gemv: GemvLib) -> None:
    """``run(x, "gemm8")`` blocks the weight once and uses it; without the library it is torch's int4 kernel."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    mod = QuantLinear(w, None, "int4")
    x = torch.randn(3, 64)
    assert torch.equal(mod.run(x, "gemm8"), mod.run(x, "quant")) and mod.blocked is None
    mod.gemv_lib = gemv
    got = mod.run(x, "gemm8")
    assert mod.blocked is not None and mod.blocked.n == 48
    assert mod.gemv is not None and got.shape == (3, 48)
    assert _rel_err(got, _int8_rows(x, 127) @ mod.gemv.dequantize().T) < 1e-5


def test_the_avx512_loop_is_built_only_for_cpus_that_list_it() -> None:
    assert build_flags(["avx2", "fma"]) == FLAGS
    assert build_flags(["avx2", "fma", "avx512f", "avx512bw"]) == FLAGS + AVX512_FLAGS
    assert build_flags(["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]) == FLAGS + AVX512_FLAGS + VNNI_FLAGS
    assert build_flags(["avx2", "fma", "avx512_vnni"]) == FLAGS  # VNNI's fused adds only inside the AVX-512 loop
    amx = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"]
    assert build_flags(amx) == FLAGS + AVX512_FLAGS + VNNI_FLAGS + AMX_FLAGS
    assert build_flags([f for f in amx if f != "avx512_vnni"]) == FLAGS + AVX512_FLAGS  # tiles only beside VNNI
    assert build_flags(None) == FLAGS


def test_gemv_is_closer_to_fp32_than_torchs_bf16_int4_kernel(gemv: GemvLib) -> None:
    """What the docs claim for it: the int16 activations lose far less than the bf16 cast."""
    w = torch.randn(256, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    mod = QuantLinear(w, None, "int4")
    mod.gemv_lib = gemv
    assert mod.gemv is not None and not mod.fallback
    x = torch.randn(2, 576)
    ref = x @ mod.gemv.dequantize().T  # the weight as quantized (fp32 scales)
    assert _rel_err(mod.run(x, "gemv"), ref) * 10 < _rel_err(mod.run(x, "quant"), ref)


def test_the_ops_compile_into_one_graph(gemv: GemvLib) -> None:
    """torch.compile keeps the ops opaque: no graph break around a projection (fullgraph)."""
    q, sz = _quant_int4(torch.randn(64, 64))
    w4 = pack_q4(q, sz[..., 0].T, sz[..., 1].T)
    q8, s8 = _quant_int8(torch.randn(32, 64))
    w8 = pack_q8(q8, s8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return gemv.run(torch.relu(gemv.run(x, w4)), w8) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    x = torch.randn(1, 64)
    assert torch.equal(compiled(x), f(x))


def test_a_second_load_in_one_process_builds_nothing_and_names_the_same_build(tmp_path: Path, gemv: GemvLib) -> None:
    """A second load (in this process: the ops are already registered) compiles nothing; the cache
    key names the build, so a table measured with it is not read by a start without it."""
    again = load_gemv(tmp_path)
    assert again is not None and again.path.name == gemv.path.name
    assert not (tmp_path / "kernels").exists()


def _rounded_tiny(data_dir: Path) -> LoadedModel:
    """The tiny model with its projections rounded to what int4 (lm_head: int8) holds, as the default
    model's are (its GGUF is 4-bit): quantizing them again gives back the same values."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                q, sz = _quant_int4(lin.weight.float())
                lin.weight.copy_(pack_q4(q, sz[..., 0].T, sz[..., 1].T).dequantize())
        q8, s8 = _quant_int8(lm.model.lm_head.weight.float())
        lm.model.lm_head.weight.copy_(q8.float() * s8[:, None])
    return lm


def test_gemv_decodes_the_tokens_of_the_float_model_it_quantizes(data_dir: Path, tmp_path: Path) -> None:
    """Every decode step on gemv (prefill on the float weight): greedy tokens equal transformers'
    generate on the same float weights, i.e. the kernel is as good as fp32 here (torch's bf16 kernel
    is not held to this)."""
    lm = _rounded_tiny(data_dir)
    plan = build_plan(lm.model, "int4")
    table = tune_plan(lm.model, plan, name=lm.name, dtype=lm.dtype, dense_rows=32, max_batch=8, data_dir=tmp_path,
                      setting="gemv")
    assert table.source == "override" and all(b == ((8, "gemv"),) for b in table.bands.values())
    mods = [m for role in ROLES for m in plan_for(lm.model).projections(role)]
    assert all(isinstance(m, QuantLinear) and m.gemv is not None and m.gemv_lib is not None for m in mods)
    prompts = prompts_of(lm, TEXTS)
    got = run_all(Engine(lm, max_batch=8), prompts, GREEDY)
    assert got == {k: hf_greedy(lm, p, GREEDY.max_tokens) for k, p in prompts.items()}

