"""The one-row decode step compiled by torch.compile (generator.compiled, TOKENPIPE_DECODE_COMPILE)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from bench.kvstep import RawSteps
from bench.stepsplit import projections_stubbed
from generator.compiled import MAX_GRAPHS, CompiledDecode, resolve_decode_compile, widths_for
from generator.engine import Engine
from generator.forward import plan_for
from generator.kvcache import BLOCK_SIZE
from generator.models import LoadedModel
from tokenpipe.errors import ConfigError
from tokenpipe.wire import SamplingParams

from .test_engine import TEXTS, prompts_of, run_all
from .test_heal import reference, running_stack, stream
from .test_resilience import assert_contiguous


def test_graph_widths_double_up_to_the_longest_context_and_stop_at_the_recompile_limit() -> None:
    assert widths_for(2048) == (8, 16, 32, 64, 128)
    assert widths_for(160) == (8, 10)  # the widest is what max_seq_len needs, not the next power of two
    assert widths_for(100) == (7,)
    assert len(widths_for(1 << 20)) == MAX_GRAPHS  # longer contexts decode eagerly past the last graph


def test_decode_compile_is_refused_off_the_cpu_and_for_unknown_values() -> None:
    assert resolve_decode_compile("on", torch.device("cpu")) is True
    assert resolve_decode_compile("off", torch.device("cuda")) is False
    with pytest.raises(ConfigError, match="CUDA graphs serve"):
        resolve_decode_compile("on", torch.device("cuda"))
    with pytest.raises(ConfigError, match="use on or off"):
        resolve_decode_compile("auto", torch.device("cpu"))


def test_compiled_one_row_steps_give_the_eager_engines_tokens(tiny_model: LoadedModel) -> None:
    """Sequences one at a time, long enough to cross from the 128-position graph into the next;
    a batch of four at the end runs eagerly beside them."""
    params = SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True)
    compiled = Engine(tiny_model, max_batch=4, max_seq_len=160, decode_compile="on")
    eager = Engine(tiny_model, max_batch=4, max_seq_len=160)
    assert compiled.compiled is not None and compiled.compiled.widths == (8, 10)
    prompts = prompts_of(tiny_model, TEXTS)
    for key, prompt in prompts.items():
        assert run_all(compiled, {key: prompt}, params) == run_all(eager, {key: prompt}, params)
    assert compiled.compiled.steps == 139 * len(prompts)  # every one-row decode step (the first token is prefill)
    assert run_all(compiled, prompts, params) == run_all(eager, prompts, params)


def test_graphs_traced_with_stubbed_projections_never_serve_the_real_ones(tiny_model: LoadedModel) -> None:
    """Regression: the graphs do not guard the model's modules, and two instances once shared one
    dynamo cache, so `bench.stepsplit --compile` ran the whole step's graph on stubbed projections
    (AttributeError: '_Zeros' object has no attribute 'qweight'). Each instance has its own now."""
    raw = RawSteps(tiny_model, 1, 100)
    raw.prefill(torch.tensor([[1, 2, 3]]))
    eager = raw.decode(torch.tensor([4]), torch.tensor([3]), 4)
    real, stub = (CompiledDecode(tiny_model.model, raw.cache, max_seq_len=100) for _ in range(2))
    blocks = raw.tables[0].tolist()
    slot = blocks[0] * BLOCK_SIZE + 3

    def through(graphs: CompiledDecode) -> torch.Tensor:
        out = graphs.decode(4, 3, slot, blocks)
        assert out is not None
        return out

    assert torch.allclose(through(real), eager, atol=1e-4)
    plan, cfg = plan_for(tiny_model.model), tiny_model.model.config
    with projections_stubbed(plan, int(cfg.hidden_size), int(cfg.vocab_size)):
        assert not through(stub).any()
    assert torch.allclose(through(real), eager, atol=1e-4)
    assert real.steps == 2 and stub.steps == 1


async def test_tokenpipe_up_with_the_compiled_step_logs_each_compile_and_streams_the_eager_tokens(
        tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_model: LoadedModel) -> None:
    """`TOKENPIPE_DECODE_COMPILE=on tokenpipe up`: both graphs compiled before the stack is up, each
    logged; a stream that crosses from one graph into the next gives the eager reference's tokens."""
    body = {"prompt": "keep going", "max_tokens": 140, "temperature": 0, "ignore_eos": True}
    async with running_stack(tmp_path_factory, data_dir, "compiled", 1, TOKENPIPE_DECODE_COMPILE="on",
                             TOKENPIPE_MAX_SEQ_LEN="160") as up:
        assert up.output().count("compiled a decode graph") == 2, up.output()[-3000:]
        async with httpx.AsyncClient(base_url=up.url, timeout=120) as http:
            _, events = await stream(http, body)
        assert events[-1][0] == "done", events[-1]
        assert assert_contiguous(events, 140) == reference(tiny_model, body)


def test_each_layers_kv_is_its_own_tensor_so_a_compiled_write_does_not_copy_the_whole_pool(
        tiny_model: LoadedModel) -> None:
    """Regression: with every layer's K/V a view of one pool tensor, the compiled step wrote them
    as a scatter into that whole base, copying the entire pool every step (230 against 30 ms a
    token for SmolLM2 with a 750 MB pool)."""
    engine = Engine(tiny_model, max_batch=2, max_seq_len=64)
    bases = {kv.untyped_storage().data_ptr() for kv in engine.cache.kv}
    assert len(bases) == len(engine.cache.kv)
