"""The kernel table measured in the background (generator.model.tuning): a start serves at once under the rules,
the engine thread measures while idle, one process measures per machine and model, a busy machine blocks
nothing; on the tiny random model in int4."""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from generator.engine.handle import Emission, Job
from generator.engine.runner import Runner
from generator.engine.scheduler import Engine
from generator.model.autotune import BUSY_SHARE, prepare_plan, write_cache
from generator.model.cachelock import CacheLock
from generator.model.kerneltable import KernelTable
from generator.model.loader import LoadedModel, load_model
from generator.model.plan import plan_for
from generator.model.tuning import POLL_S, QUIET_S, BackgroundTuning, tune_in_background
from tests.conftest import wait_until
from tests.test_engine import GREEDY, TEXTS, prompts_of, run_all
from tests.test_kernels import busy_cores  # noqa: F401 - a fixture
from tokenpipe.wire import Request, SamplingParams


@pytest.fixture()
def int4_tiny(data_dir: Path) -> LoadedModel:
    return load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")


def _start(lm: LoadedModel, where: Path, busy_share: float | None = None,
           setting: str = "auto") -> tuple[KernelTable, BackgroundTuning | None]:
    """A generator's start on the data dir ``where`` (by default whatever else the machine runs does not matter)."""
    return tune_in_background(lm.model, plan_for(lm.model), name=lm.name, dtype=lm.dtype, dense_rows=32, max_batch=4,
                              data_dir=str(where), setting=setting, busy_share=busy_share)


def _rules_model(data_dir: Path, where: Path) -> LoadedModel:
    """The reference: the same model under the rules ``_start`` serves while it measures."""
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    assert _start(lm, where, setting="rules")[1] is None
    return lm


def _drive(tuning: BackgroundTuning) -> None:
    """Run the measurement to its end, as an idle engine thread would (no other process holds the lock here)."""
    while (wait := tuning.step()) is not None:
        assert wait == 0


def _tables(where: Path) -> list[Path]:
    return list((where / "kernels").glob("*.json"))


def test_a_second_start_reads_the_table_the_first_measured_in_the_background(int4_tiny: LoadedModel,
                                                                              tmp_path: Path) -> None:
    """A start without a cached table serves the rules at once and measures later; the next start on the same
    data dir reads that table and measures nothing."""
    first, tuning = _start(int4_tiny, tmp_path)
    assert first.source == "rules" and tuning is not None and not _tables(tmp_path)
    plan = plan_for(int4_tiny.model)
    assert plan.projections("qkv")[0].bands == first.bands["qkv"]  # applied: it serves now
    _drive(tuning)
    assert tuning.done and tuning.measurements == 1 and tuning.table.source == "measured"
    assert len(_tables(tmp_path)) == 1
    assert plan.projections("down")[0].bands == tuning.table.bands["down"]  # swapped in
    second, again = _start(int4_tiny, tmp_path)
    assert again is None and second.source == "cache" and second.bands == tuning.table.bands


def test_tokens_served_while_the_table_is_measured_are_the_rules_tokens(data_dir: Path, tmp_path: Path) -> None:
    """Between any two units of the measurement (which apply other tables to time them) the engine decodes
    exactly the greedy tokens of an engine under the rules."""
    ref = _rules_model(data_dir, tmp_path / "ref")
    prompts = prompts_of(ref, TEXTS[:2])
    expected = run_all(Engine(ref, max_batch=4), prompts, GREEDY)
    lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4")
    _, tuning = _start(lm, tmp_path)
    assert tuning is not None
    units = 0
    while tuning.step() is not None:
        units += 1
        if units % 4 == 1:  # the measuring units and the confirming steps alike
            assert run_all(Engine(lm, max_batch=4), prompts, GREEDY) == expected, units
    assert units > 4 and tuning.table.source == "measured"


async def test_the_engine_thread_serves_while_another_process_measures_then_measures_itself(
        int4_tiny: LoadedModel, data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A runner whose table another process is measuring (it holds the lock) serves a request under the rules at
    once; once that process lets go without a table, the idle engine thread measures it and swaps it in."""
    _, tuning = _start(int4_tiny, tmp_path)
    assert tuning is not None
    int4_tiny.tuning = tuning
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    request = Request.create("tiny-random", prompt="The quick brown fox", params=params)
    got: list[int] = []
    finished = threading.Event()

    def on_emit(batch: list[Emission]) -> None:
        for e in batch:
            got.extend(e.token_ids)
            if e.finish is not None:
                finished.set()

    lock_path = tuning.path.with_suffix(".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    runner = Runner(int4_tiny, on_emit, max_batch=4)
    with open(lock_path, "a") as lock, caplog.at_level(logging.INFO, logger="generator.model.tuning"):
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process", measuring
        runner.start()
        try:
            runner.submit(Job(request))
            assert finished.wait(120), "the request was not served while the table was pending"
            assert tuning.measurements == 0 and not tuning.done
            fcntl.flock(lock, fcntl.LOCK_UN)  # it stopped without caching a table: this one measures
            await wait_until(lambda: tuning.done, timeout=180, what="the table measured on the idle engine thread")
        finally:
            runner.stop()
    assert int4_tiny.kernels is tuning.table and tuning.table.source == "measured" and tuning.measurements == 1
    assert len(_tables(tmp_path)) == 1
    rules = _rules_model(data_dir, tmp_path / "ref")
    engine = Engine(rules, max_batch=1)
    assert request.prompt is not None
    seq = engine.new_sequence(request.id, rules.tokenizer.encode(request.prompt), params)
    engine.add(seq)
    engine.run_to_completion()
    assert got == seq.generated
    messages = [r.getMessage() for r in caplog.records]
    assert any("another process is measuring the kernel table" in m for m in messages)
    assert any(m.startswith("kernel table (measured) replaces the rules table") for m in messages)


_START_IN_CHILD = """
import sys, time
from generator.model.loader import load_model
from generator.model.plan import plan_for
from generator.model.tuning import tune_in_background
lm = load_model("tiny-random", device="cpu", dtype="float32", data_dir=sys.argv[1], quant="int4")
table, tuning = tune_in_background(lm.model, plan_for(lm.model), name=lm.name, dtype=lm.dtype, dense_rows=32,
                                   max_batch=4, data_dir=sys.argv[2], busy_share=None)
while tuning is not None and (wait := tuning.step()) is not None:
    time.sleep(wait)  # an idle engine thread's wait for the next piece
print(tuning.measurements if tuning else 0, (tuning.table if tuning else table).source, flush=True)
"""


def test_two_generators_starting_together_measured_the_kernel_table_twice(data_dir: Path, tmp_path: Path) -> None:
    """Two processes starting together on one fresh data dir: one measures the table, the other serves the rules
    until it reads that one's table (issue 49: `tokenpipe up --generators 2` measured it twice, 66 s)."""
    procs = [subprocess.Popen([sys.executable, "-c", _START_IN_CHILD, str(data_dir), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    results = sorted(tuple(out.split()) for out, _ in outs)
    assert results == [("0", "cache"), ("1", "measured")], outs
    assert len(_tables(tmp_path)) == 1


def test_a_busy_machine_neither_blocks_the_start_nor_caches_its_table(
        int4_tiny: LoadedModel, tmp_path: Path, busy_cores: None,  # noqa: F811 - the fixture
        caplog: pytest.LogCaptureFixture) -> None:
    """Other processes hold every core: the start serves the rules at once; each background measurement is not
    trusted, measured again after a pause, at most ``attempts`` times, and nothing is cached."""
    plan = plan_for(int4_tiny.model)
    first, pending = _start(int4_tiny, tmp_path, busy_share=BUSY_SHARE)
    assert first.source == "rules" and pending is not None
    tunable = prepare_plan(int4_tiny.model, plan, dtype=int4_tiny.dtype, dense_rows=32, max_batch=1,  # one row: quick
                           name=int4_tiny.name, data_dir=str(tmp_path))
    tuning = BackgroundTuning(int4_tiny.model, plan, tunable, dtype=int4_tiny.dtype, name=int4_tiny.name,
                              busy_share=BUSY_SHARE, retry_s=0.0, attempts=2, quiet_wait_s=0.0)
    with caplog.at_level(logging.WARNING, logger="generator.model.tuning"):
        _drive(tuning)
    assert tuning.done and tuning.measurements == 2 and tuning.table.source == "rules"
    assert plan.projections("o")[0].bands == tunable.rules.bands["o"] and not _tables(tmp_path)
    assert [r.getMessage().rsplit("; ", 1)[-1] for r in caplog.records if "not trusted" in r.getMessage()] == [
        "measuring again in 0 s", "the rules table serves this run (not cached: the next start measures again)"]


def test_a_process_pausing_after_an_untrusted_table_takes_the_one_another_process_cached(
        int4_tiny: LoadedModel, tmp_path: Path) -> None:
    """Its measurement not trusted (here: any share of other processes is too much), a process pauses before
    measuring again; a table another process caches meanwhile serves at once, without that second measurement."""
    plan = plan_for(int4_tiny.model)
    tunable = prepare_plan(int4_tiny.model, plan, dtype=int4_tiny.dtype, dense_rows=32, max_batch=1,
                           name=int4_tiny.name, data_dir=str(tmp_path))
    assert tunable.key is not None and tunable.path is not None
    tuning = BackgroundTuning(int4_tiny.model, plan, tunable, dtype=int4_tiny.dtype, name=int4_tiny.name,
                              busy_share=-1.0, retry_s=600.0, quiet_wait_s=0.0)
    while (wait := tuning.step()) == 0:
        pass
    assert wait is not None and 0 < wait <= POLL_S and tuning.measurements == 1 and not _tables(tmp_path)
    other = KernelTable({role: ((1, "dense"),) for role in tunable.rules.bands}, 0, source="measured")
    write_cache(tunable.path, other.to_json(tunable.key))  # "another process" measured and cached it
    assert tuning.step() is None and tuning.measurements == 1
    assert tuning.table.source == "cache" and plan.projections("qkv")[0].bands == ((1, "dense"),)


def test_the_generators_of_one_start_on_a_busy_machine_measured_three_times_each(
        int4_tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The pause and the count after an untrusted table are the data dir's: a second process (here a second
    tuning on the same lock file) takes the first one's pause instead of measuring at once, and gives up without
    measuring once the attempts in a row are spent (issue 49: `tokenpipe up --generators 2` on a busy 2-core
    machine measured six times)."""
    plan = plan_for(int4_tiny.model)
    tunable = prepare_plan(int4_tiny.model, plan, dtype=int4_tiny.dtype, dense_rows=32, max_batch=1,
                           name=int4_tiny.name, data_dir=str(tmp_path))

    def tuning(attempts: int) -> BackgroundTuning:
        return BackgroundTuning(int4_tiny.model, plan, tunable, dtype=int4_tiny.dtype, name=int4_tiny.name,
                                busy_share=-1.0, retry_s=600.0, attempts=attempts,  # no share is low enough
                                quiet_wait_s=0.0)

    first = tuning(3)
    while first.step() == 0:
        pass
    assert first.measurements == 1 and not first.done
    second = tuning(3)
    wait = second.step()
    assert wait is not None and 0 < wait <= POLL_S and second.measurements == 0 and not second.done
    with caplog.at_level(logging.WARNING, logger="generator.model.tuning"):
        third = tuning(1)
        assert third.step() is None
    assert third.done and third.measurements == 0 and third.table.source == "rules"
    assert any("the last 1 measurement(s) of the kernel table" in r.getMessage() for r in caplog.records)
    first.close()
    second.close()


def test_a_second_generator_loading_made_the_first_ones_measurement_untrusted(
        int4_tiny: LoadedModel, tmp_path: Path, busy_cores: None) -> None:  # noqa: F811 - the fixture
    """While other processes hold the CPUs (on a fresh `tokenpipe up --generators 2`, the second generator
    loading its model), the first does not begin its measurement: it would slow the other and not be trusted.
    It watches for a quiet second instead, holding no lock."""
    plan = plan_for(int4_tiny.model)
    tunable = prepare_plan(int4_tiny.model, plan, dtype=int4_tiny.dtype, dense_rows=32, max_batch=1,
                           name=int4_tiny.name, data_dir=str(tmp_path))
    assert tunable.path is not None
    tuning = BackgroundTuning(int4_tiny.model, plan, tunable, dtype=int4_tiny.dtype, name=int4_tiny.name,
                              busy_share=BUSY_SHARE, quiet_wait_s=600.0)
    for _ in range(3):
        wait = tuning.step()
        assert wait == QUIET_S
        threading.Event().wait(wait)  # the idle engine thread's wait before its next look (a measuring window)
    other = CacheLock(tunable.path)
    assert other.try_take() and tuning.measurements == 0 and not tuning.done  # nothing measured, no lock held
    other.release()
    tuning.close()
