"""Decode over static buffers (generator.engine.graphs) on CPU: the bucket and padding logic, the
fallback of `--cuda-graphs`, and the padded-buffer path against the plain decode step.

The capture itself needs a CUDA device; `bench/gpu.sh` runs it. What runs here is the same
padded step, uncaptured, so a wrong pad row or table would change the tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from generator.engine.graphs import (
    BUCKETS,
    StaticDecode,
    bucket_for,
    buckets_for,
    pad_rows,
    resolve_cuda_graphs,
    sample_on_device,
    table_width,
)
from generator.engine.sampling import RowSampler, sample
from generator.engine.scheduler import Engine
from generator.model.kvcache import BLOCK_SIZE, SCRATCH
from generator.model.loader import LoadedModel
from tokenpipe.errors import ConfigError
from tokenpipe.wire import SamplingParams

pytestmark = pytest.mark.timeout(180)


def test_buckets_cover_max_batch_with_powers_of_two() -> None:
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(1) == (1,)
    assert buckets_for(500) == BUCKETS  # beyond the largest: those steps run uncaptured
    assert [bucket_for(n, buckets_for(32)) for n in (1, 2, 3, 5, 9, 17, 32, 33)] == [1, 2, 4, 8, 16, 32, 32, None]


def test_pad_rows_fills_the_bucket_with_scratch_rows() -> None:
    tok, pos, slot, table = pad_rows([7, 8], [20, 3], [5 * BLOCK_SIZE + 4, 9 * BLOCK_SIZE + 3], [[4, 5], [9]], 4,
                                     table_width(64))
    assert tok.tolist() == [7, 8, 0, 0] and pos.tolist() == [20, 3, 0, 0]
    assert slot.tolist() == [5 * BLOCK_SIZE + 4, 9 * BLOCK_SIZE + 3, SCRATCH * BLOCK_SIZE, SCRATCH * BLOCK_SIZE]
    assert table.tolist() == [[4, 5, SCRATCH, SCRATCH], [9] + [SCRATCH] * 3, [SCRATCH] * 4, [SCRATCH] * 4]
    with pytest.raises(ValueError):
        pad_rows([1, 2, 3], [0, 0, 0], [0, 0, 0], [[1], [2], [3]], 2, 4)


def test_cuda_graphs_fall_back_on_cpu_and_on_is_refused() -> None:
    cpu = torch.device("cpu")
    assert resolve_cuda_graphs("auto", cpu) is False
    assert resolve_cuda_graphs("off", cpu) is False
    assert resolve_cuda_graphs("auto", torch.device("cuda")) is True
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        resolve_cuda_graphs("on", cpu)
    with pytest.raises(ConfigError, match="use one of"):
        resolve_cuda_graphs("yes", cpu)


def test_generator_with_cuda_graphs_on_without_cuda_exits_with_a_config_error() -> None:
    """`tokenpipe generator --cuda-graphs on` on a CPU machine: refused at start, before any model loads."""
    done = subprocess.run([sys.executable, "-m", "tokenpipe_cli", "generator", "--cuda-graphs", "on",
                           "--device", "cpu", "--nats-url", "nats://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "CUDA graphs need a CUDA device" in done.stderr


def _run(lm: LoadedModel, static: bool, params: list[SamplingParams]) -> list[list[int]]:
    engine = Engine(lm, max_batch=8, max_seq_len=256)
    if static:  # the captured path's buffers and padding, run eagerly
        engine.static = StaticDecode(engine.model, engine.cache, max_batch=8, max_seq_len=engine.max_seq_len,
                                     device=engine.device)
    seqs = []
    for i, p in enumerate(params):  # 5 rows: bucket 8 pads three; finishing rows walk down the buckets
        seq = engine.new_sequence(f"r{i}", [1 + i, 5, 9, 20 + i] * (i + 1), p)
        engine.add(seq)
        seqs.append(seq)
    engine.run_to_completion()
    return [s.generated for s in seqs]


def test_static_buffer_decode_gives_the_plain_steps_tokens(tiny_model: LoadedModel) -> None:
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=0, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))
    plain = _run(tiny_model, False, params)
    assert [len(g) for g in plain] == [20, 29, 38, 47, 50]
    assert _run(tiny_model, True, params) == plain


def test_sample_on_device_draws_what_sample_draws() -> None:
    """Every branch (greedy, temperature only, top-k, nucleus inside and beyond the candidates)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 3
    logits[5] = 0.0  # flat: a 0.95 nucleus reaches beyond the 256 candidates
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.0, top_k=5, seed=2), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.95, seed=4)]
    for _ in range(3):
        a = [RowSampler.from_params(p, torch.device("cpu")) for p in params]
        b = [RowSampler.from_params(p, torch.device("cpu")) for p in params]
        assert sample_on_device(logits, a) == sample(logits, b)
        logits = logits.roll(1, -1)
