"""Projection kernels chosen by measurement (generator.model.kerneltable, generator.model.autotune) on the tiny random
model."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from generator.engine.scheduler import Engine
from generator.model import autotune, cachelock
from generator.model.autotune import BUSY_SHARE, OthersLoad, apply_table, tune_plan
from generator.model.kerneltable import (
    MARGIN,
    ROLES,
    KernelTable,
    bands_from,
    cache_file,
    cache_key,
    choose,
    kernel_for,
    row_counts,
    rule_table,
    rules_kernel,
)
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear
from generator.model.stack import ROLES as STACK_ROLES
from tests.test_engine import GREEDY, TEXTS, hf_greedy, prompts_of, run_all
from tokenpipe.errors import ConfigError
from tokenpipe.settings import Settings


# -- the band logic, as pure functions ------------------------------------------------------
def test_choose_switches_only_on_a_clear_win() -> None:
    assert choose({"quant": 1.0, "dense": 0.95}, "quant") == "quant"  # 5 %: noise, keep the default
    assert choose({"quant": 1.0, "dense": 1 - MARGIN - 0.01}, "quant") == "dense"
    assert choose({"quant": 1.0, "dense": 0.5, "packed": 0.4}, "quant") == "packed"
    assert choose({"quant": 1.0, "packed": 2.0}, "dense") == "quant"  # default not measured: the fastest


def test_bands_merge_consecutive_choices_and_rows_between_take_the_upper_count() -> None:
    bands = bands_from({8: "quant", 1: "quant", 12: "packed", 16: "packed", 24: "dense", 32: "dense"})
    assert bands == ((8, "quant"), (16, "packed"), (32, "dense"))
    assert [kernel_for(bands, r) for r in (1, 8, 9, 16, 17, 32)] == ["quant", "quant", "packed", "packed",
                                                                      "dense", "dense"]
    assert kernel_for(bands, 33) == "dense"  # a prefill: the float weight
    assert kernel_for((), 1) == "dense"


def test_row_counts_cover_the_engine_batch() -> None:
    assert row_counts(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert row_counts(10) == (1, 2, 4, 8, 10)
    assert row_counts(64)[-2:] == (32, 64)


def test_rule_table_is_todays_hand_rule() -> None:
    rules = rule_table(row_counts(32), 16, quantized=True, attention_fp32_rows=2)
    assert rules.bands["qkv"] == ((16, "quant"), (32, "dense")) and rules.attention_fp32_rows == 2
    assert rule_table(row_counts(32), 32, quantized=False, attention_fp32_rows=2).bands["o"] == ((32, "dense"),)
    assert rule_table(row_counts(8), 16, quantized=True, attention_fp32_rows=2, forced="packed").bands["down"] == \
        ((8, "packed"),)


def test_rule_table_takes_the_kernel_its_cpu_familys_tables_measured() -> None:
    """Regression (issue 49): on the AVX2-only EPYC the rules ran torch's int4 kernel, 47 tok/s for one stream
    where the table measured later (gemm8) ran 108: a first start served that until it had idled 13 s."""
    avx2 = rule_table(row_counts(32), 16, quantized=True, attention_fp32_rows=2, level="avx2")
    assert all(bands == ((16, "gemm8"), (32, "dense")) for bands in avx2.bands.values()) and avx2.source == "rules"
    assert rule_table(row_counts(32), 16, quantized=True, attention_fp32_rows=2, level="avx512vnni").bands["o"] == \
        ((16, "quant"), (32, "dense"))
    assert rule_table(row_counts(8), 16, quantized=True, attention_fp32_rows=2, level="avx2",
                      forced="packed").bands["o"] == ((8, "packed"),)


def test_cache_key_names_what_the_table_depends_on() -> None:
    key = cache_key("m", "int4", torch.bfloat16, (1, 2), threads=2, cpu=("AMD EPYC", "abc"))
    assert {k: key[k] for k in ("cpu", "flags", "threads", "model", "quant", "dtype")} == {
        "cpu": "AMD EPYC", "flags": "abc", "threads": 2, "model": "m", "quant": "int4", "dtype": "bfloat16"}
    assert key["torch"] == torch.__version__ and key["cores"] >= 1
    other = cache_key("m", "int4", torch.bfloat16, (1, 2), threads=1, cpu=("AMD EPYC", "abc"))
    assert cache_file("/d", key) != cache_file("/d", other)


def test_kernels_setting_is_validated() -> None:
    assert Settings.load(env={}).kernels == "auto"
    assert Settings.load(env={"TOKENPIPE_KERNELS": "packed"}).kernels == "packed"
    with pytest.raises(ConfigError, match="TOKENPIPE_KERNELS='fast'"):
        Settings.load(env={"TOKENPIPE_KERNELS": "fast"})


# -- measured, cached, overridden -----------------------------------------------------------
@pytest.fixture()
def int4_tiny(data_dir: Path) -> LoadedModel:
    return load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")


def _tune(lm: LoadedModel, where: Path, setting: str = "auto", max_batch: int = 4,
          busy_share: float | None = None) -> KernelTable:
    """Tune into ``where``; by default whatever else the machine runs (a busy CI host) does not matter."""
    return tune_plan(lm.model, plan_for(lm.model), name=lm.name, dtype=lm.dtype, dense_rows=32, max_batch=max_batch,
                     data_dir=where, setting=setting, busy_share=busy_share)


def test_table_is_measured_then_read_from_the_cache(int4_tiny: LoadedModel, tmp_path: Path) -> None:
    first = _tune(int4_tiny, tmp_path)
    assert first.source == "measured" and first.seconds > 0
    assert set(first.times_us) == set(ROLES) and set(first.times_us["qkv"]) == {"1", "2", "4"}
    assert all(t > 0 for t in first.times_us["gate_up"]["4"].values())
    files = list((tmp_path / "kernels").glob("*.json"))
    assert len(files) == 1
    second = _tune(int4_tiny, tmp_path)
    assert second.source == "cache" and second.bands == first.bands
    assert second.attention_fp32_rows == first.attention_fp32_rows
    assert second.paged_attention_rows == first.paged_attention_rows
    assert plan_for(int4_tiny.model).paged_attention_rows == first.paged_attention_rows
    changed = _tune(int4_tiny, tmp_path, max_batch=2)  # another key (rows): measured again, its own file
    assert changed.source == "measured" and len(list((tmp_path / "kernels").glob("*.json"))) == 2
    plan = plan_for(int4_tiny.model)
    assert all(m.bands == changed.bands["qkv"] for m in plan.projections("qkv") if isinstance(m, QuantLinear))


def test_corrupt_cache_is_measured_again_with_a_warning(int4_tiny: LoadedModel, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    _tune(int4_tiny, tmp_path)
    (path,) = (tmp_path / "kernels").glob("*.json")
    path.write_text('{"version": 1, "key": ')
    with caplog.at_level(logging.WARNING, logger="generator.model.autotune"):
        again = _tune(int4_tiny, tmp_path)
    assert again.source == "measured"
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert _tune(int4_tiny, tmp_path).source == "cache"  # rewritten whole


@pytest.fixture()
def busy_cores() -> Iterator[None]:
    """One busy-loop process per CPU, each running (it said so) before the test goes on."""
    loops = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                              stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count() or 1)]
    try:
        for p in loops:
            assert p.stdout is not None and p.stdout.readline().strip() == "spinning"
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def test_others_load_counts_other_processes_not_this_one(busy_cores: None) -> None:
    load = OthersLoad()
    sum(i * i for i in range(3_000_000))  # this process's own work is not "others"
    share = load.share()
    assert share is not None and share > 0.5, share


def test_kernel_table_measured_on_a_busy_machine_was_cached_for_good(
        int4_tiny: LoadedModel, tmp_path: Path, busy_cores: None, caplog: pytest.LogCaptureFixture) -> None:
    """Other processes held every core while the table was measured: it is not kept (the rules serve the
    run) nor cached (the next start measures again), and the log says why."""
    with caplog.at_level(logging.WARNING, logger="generator.model.autotune"):
        table = _tune(int4_tiny, tmp_path, busy_share=BUSY_SHARE)
    assert table.source == "rules" and table.seconds > 0
    assert table.bands == _tune(int4_tiny, tmp_path / "other", setting="rules").bands
    assert not list((tmp_path / "kernels").glob("*.json"))
    assert [r.getMessage().rsplit("; ", 1)[-1] for r in caplog.records if "not trusted" in r.getMessage()] == [
        "measuring again", "the rules serve this run (not cached: the next start measures again)"]


_TUNE_IN_CHILD = """
import logging, sys
from generator.model.autotune import tune_plan
from generator.model.loader import load_model
from generator.model.plan import plan_for
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=sys.argv[1], quant="int4", kernels="rules")
print("loaded", file=sys.stderr, flush=True)
table = tune_plan(lm.model, plan_for(lm.model), name=lm.name, dtype=lm.dtype, dense_rows=32, max_batch=4,
                  data_dir=sys.argv[2], busy_share=None)
print(table.source, flush=True)
"""


def test_a_second_generator_measured_the_kernels_at_the_same_moment_as_the_first(
        int4_tiny: LoadedModel, data_dir: Path, tmp_path: Path) -> None:
    """While one process holds the measurement lock, a second one waits (and says so) rather than
    measuring too, then reads the table the first one cached."""
    _tune(int4_tiny, tmp_path)
    (table_file,) = (tmp_path / "kernels").glob("*.json")
    text = table_file.read_text()
    table_file.unlink()
    with open(table_file.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "the first process", measuring
        child = subprocess.Popen([sys.executable, "-c", _TUNE_IN_CHILD, str(data_dir), str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        waiting = threading.Event()

        def read_log() -> None:
            assert child.stderr is not None
            for line in child.stderr:
                lines.append(line)
                if "waiting for its result" in line:
                    waiting.set()
        reader = threading.Thread(target=read_log, daemon=True)
        reader.start()
        try:
            assert waiting.wait(180), "".join(lines)
            table_file.write_text(text)  # the first process's table, cached as it lets go
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    out, _ = child.communicate(timeout=180)
    reader.join(10)
    assert child.returncode == 0, "".join(lines)
    assert out.split() == ["cache"], "".join(lines)


def test_a_start_waited_for_good_on_a_stopped_process_holding_the_kernel_lock(
        int4_tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A measuring process frozen (SIGSTOP) keeps its lock: another start waits a bounded time, then measures."""
    _tune(int4_tiny, tmp_path)
    (table_file,) = (tmp_path / "kernels").glob("*.json")
    table_file.unlink()
    monkeypatch.setattr(cachelock, "_LOCK_WAIT_S", 0.5)
    with open(table_file.with_suffix(".lock"), "a") as lock, \
            caplog.at_level(logging.INFO, logger="generator.model.cachelock"):
        fcntl.flock(lock, fcntl.LOCK_EX)  # never let go while the start runs
        table = _tune(int4_tiny, tmp_path)
    assert table.source == "measured" and table_file.exists()
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for its result" in m for m in messages) and any("going on without it" in m for m in messages)


def test_override_wins_over_the_cache(int4_tiny: LoadedModel, tmp_path: Path) -> None:
    _tune(int4_tiny, tmp_path)
    forced = _tune(int4_tiny, tmp_path, setting="packed")
    assert forced.source == "override" and all(b == ((4, "packed"),) for b in forced.bands.values())
    plan = plan_for(int4_tiny.model)
    assert all(m.packed is not None for m in plan.projections("down") if isinstance(m, QuantLinear))
    rules = _tune(int4_tiny, tmp_path, setting="rules")
    lib = next(m.gemv_lib for m in plan.projections("o") if isinstance(m, QuantLinear))
    by_rule = rules_kernel(lib.level if lib is not None else "")  # this CPU family's
    assert rules.source == "rules" and rules.bands["o"] == ((4, by_rule),)
    assert all(m.packed is None for m in plan.projections("down") if isinstance(m, QuantLinear))  # memory back


def test_unquantized_plans_keep_the_rules_without_measuring(tiny_model: LoadedModel, tmp_path: Path) -> None:
    table = _tune(tiny_model, tmp_path)
    assert table.source == "rules" and not (tmp_path / "kernels").exists()


@pytest.mark.parametrize("kernel", ["packed", "dense"])
def test_float_kernels_give_the_float_models_tokens(data_dir: Path, tmp_path: Path, kernel: str) -> None:
    """Greedy tokens of an int4 engine whose table puts every decode step on the float weight (plain or
    pre-packed) are the float model's own (transformers' generate on the same weights)."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    _tune(lm, tmp_path, setting=kernel, max_batch=8)
    prompts = prompts_of(lm, TEXTS)
    got = run_all(Engine(lm, max_batch=8), prompts, GREEDY)
    assert got == {k: hf_greedy(lm, p, GREEDY.max_tokens) for k, p in prompts.items()}


def test_measured_table_engine_matches_the_reference_for_the_same_kernels(data_dir: Path, tmp_path: Path) -> None:
    """One stream under the measured (banded) table decodes the tokens of a copy whose every projection
    is forced onto the kernel that table picks at one row (prompts longer than the measured rows: both
    prefill on the float weight)."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    table = _tune(lm, tmp_path)
    ref = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    flat = KernelTable({role: ((1, kernel_for(table.bands[role], 1)),) for role in ROLES}, table.attention_fp32_rows)
    apply_table(plan_for(ref.model), flat)
    prompts = prompts_of(lm, [t + " and so on, as before" for t in TEXTS])
    assert min(len(p) for p in prompts.values()) > 4
    for key, prompt in prompts.items():
        got = run_all(Engine(lm, max_batch=1), {key: prompt}, GREEDY)
        assert got == run_all(Engine(ref, max_batch=1), {key: prompt}, GREEDY), (key, table.summary())


def test_kernels_benchmark_runs_end_to_end(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bench.kernels`` on the tiny model: a measured table, its start-up cost, both variants timed."""
    import json

    from bench.kernels import main

    for key, value in {"MODEL": "tiny-random", "QUANT": "int4", "DTYPE": "float32", "MAX_BATCH": "4",
                       "DATA_DIR": str(data_dir)}.items():
        monkeypatch.setenv(f"TOKENPIPE_{key}", value)
    out = tmp_path / "kernels.json"
    assert main(["--rows", "1,4", "--rounds", "2", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["startup_s"] > 0 and set(result["table"]["bands"]) == set(ROLES)
    assert set(result["decode"]) == {"1", "4"}
    assert all(len(result["decode"][r]["rounds"][v]) == 2 for r in ("1", "4") for v in ("rules", "measured"))


def test_confirming_steps_weigh_the_librarys_kernels_where_a_torch_kernel_won_a_layers_call(
        int4_tiny: LoadedModel, tmp_path: Path) -> None:
    """One torch kernel in a layer role sends the whole step op by op (generator/stack.py): the confirming
    steps also time the library's fastest kernel for every layer role, and keep the fastest step."""
    plan = plan_for(int4_tiny.model)
    _tune(int4_tiny, tmp_path, setting="gemv", max_batch=1)  # the library loaded: the stack is built
    assert plan.stack is not None
    rules = rule_table((1,), 32, quantized=True, attention_fp32_rows=0, paged_attention_rows=1)
    times = {role: {"1": {"quant": 10.0, "gemv": 30.0, "gemm8": 20.0}} for role in ROLES}
    measured = KernelTable(dict(rules.bands), 0, source="measured", times_us=times, paged_attention_rows=1)
    table = autotune._confirm(int4_tiny.model, plan, rules, measured, (1,), int4_tiny.dtype)
    assert {"rules", "library"} <= set(table.steps_ms["1"]) and "measured" not in table.steps_ms["1"]
    library = {role: "gemm8" for role in STACK_ROLES} | {"lm_head": "quant"}  # lm_head is not in the stack
    kept = {role: kernel_for(table.bands[role], 1) for role in ROLES}
    assert kept in ({role: "quant" for role in ROLES}, library)
    plan.stack = None  # without the stack a torch kernel costs the step nothing more: no third variant
    assert "library" not in autotune._confirm(int4_tiny.model, plan, rules, measured, (1,),
                                              int4_tiny.dtype).steps_ms.get("1", {})
