"""``python -m bench``: the registered scenarios are listed, each one's module imports, and the runner
reports each scenario's start, end and outcome, with a summary and a JSON record."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench.suite import GROUPS, SCENARIOS, Scenario, select

from .conftest import run_bench


def test_bench_list_names_every_registered_scenario_under_its_group() -> None:
    proc = run_bench(["bench", "list", "-v"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == list(GROUPS)
    listed = [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")]
    assert listed == [s.name for g in GROUPS for s in SCENARIOS if s.group == g]
    assert all(f"python -m {s.module}" in proc.stdout for s in SCENARIOS)


def test_scenario_names_are_unique_and_every_group_has_some() -> None:
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    assert {s.group for s in SCENARIOS} == set(GROUPS)
    assert select(["engine", "kernels", "fanout"]) == [*(s for s in SCENARIOS if s.group == "engine"),
                                                       next(s for s in SCENARIOS if s.name == "fanout")]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_each_registered_scenario_module_imports_and_takes_an_out_path(scenario: Scenario) -> None:
    """The runner calls ``python -m <module> <args> --out <json>``: the module must import (mypy does
    not see a moved module) and have a ``main`` that takes ``--out``."""
    module = importlib.import_module(scenario.module)
    assert callable(module.main)
    assert '"--out"' in Path(module.__file__ or "").read_text()


def test_bench_run_reports_each_scenario_and_writes_its_record(tmp_path: Path) -> None:
    """One cheap scenario's quick form (the relay fan-out, a few seconds) through the runner, and one that
    fails (an option its module refuses): both have their turn, each announced as it starts and ends
    (output piped, not a terminal), the summary names both, the suite exits 1 for the failure."""
    proc = run_bench(["bench", "run", "fanout", "--quick", "--out-dir", str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "==> [1/1] fanout (system) started" in proc.stdout and "==> [1/1] fanout ok after" in proc.stdout
    record = json.loads((tmp_path / "suite-fanout.json").read_text())
    [row] = record["scenarios"]
    assert row["status"] == "ok" and row["exit"] == 0 and row["json"] == str((tmp_path / "fanout.json").resolve())
    assert json.loads((tmp_path / "fanout.json").read_text())["scenarios"][0]["errors"] == 0
    assert record["quick"] and record["cpu"]["line"]

    proc = run_bench(["bench", "run", "replication", "--quick", "--out-dir", str(tmp_path), "--", "--no-such-option"],
                     timeout=120)
    assert proc.returncode == 1
    assert "==> [1/1] replication failed after" in proc.stdout
    [row] = json.loads((tmp_path / "suite-replication.json").read_text())["scenarios"]
    assert row["status"] == "failed" and row["exit"] == 2 and row["json"] is None
    assert row["command"][-1] == "--no-such-option"
    assert "replication  system  failed (2)" in proc.stdout


def test_an_optional_scenario_not_installed_is_skipped_not_failed(tmp_path: Path) -> None:
    proc = run_bench(["bench", "run", "llamaraw", "--out-dir", str(tmp_path), "--", "--llama-python",
                      str(tmp_path / "none" / "python")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads((tmp_path / "suite-llamaraw.json").read_text())["scenarios"]
    assert row["status"] == "skipped" and row["exit"] == 2


def test_bench_run_refuses_an_unknown_target_and_running_nothing() -> None:
    proc = run_bench(["bench", "run", "no-such-scenario"], timeout=60)
    assert proc.returncode == 2 and "neither a group" in proc.stderr and "==>" not in proc.stdout
