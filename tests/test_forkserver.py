"""`tokenpipe up`'s fork server (tokenpipe_cli/forkserver.py) on its own: what the supervisor relies on."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tokenpipe_cli.forkserver import ForkServer
from tokenpipe_cli.launch import free_port

from .conftest import alive, parent_of

pytestmark = pytest.mark.timeout(120)


def test_a_forked_command_reports_its_exit_status_as_a_spawned_one_would() -> None:
    forks = ForkServer()
    try:
        bad = forks.spawn("bad-flag", ["generator", "--no-such-flag"])
        assert bad.wait_or_kill(60) == 2  # argparse's exit, through the server
        assert forks.alive
    finally:
        forks.close()
    assert not forks.alive


def test_a_fork_killed_with_sigkill_is_reported_so_and_its_parent_is_the_server(tmp_path: Path) -> None:
    forks = ForkServer()
    try:
        # A long-running command: `tokenpipe nats` serves until stopped.
        child = forks.spawn("nats", ["nats", "--port", str(free_port()), "--data-dir", str(tmp_path / "nats")],
                            new_session=True)
        assert parent_of(child.pid) == forks.proc.pid
        deadline = time.monotonic() + 30
        while os.getsid(child.pid) != child.pid:  # its own session, as a spawned role's (set up after the fork)
            assert time.monotonic() < deadline, "the fork never became its own session's leader"
            time.sleep(0.05)  # polling a condition, bounded by the deadline
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait_or_kill(30) == -signal.SIGKILL
    finally:
        forks.close()


def test_when_the_server_dies_its_forks_count_as_exited_and_are_stopped(tmp_path: Path) -> None:
    forks = ForkServer()
    child = forks.spawn("nats", ["nats", "--port", str(free_port()), "--data-dir", str(tmp_path / "nats")])
    pid = child.pid
    os.kill(forks.proc.pid, signal.SIGKILL)
    # Its exit status is lost with the server: reported as the SIGTERM the fork got from the server's death.
    assert child.wait_or_kill(30) == -signal.SIGTERM
    assert not forks.alive and not forks.broken  # it had started: the supervisor starts another
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # the orphan drains and exits on its parent-death signal
    assert not alive(pid)
    forks.close()


def test_a_server_that_dies_before_it_is_ready_is_broken_so_the_supervisor_spawns() -> None:
    forks = ForkServer(preload=("no_such_module_anywhere",))  # its import fails: it exits before it is ready
    child = forks.spawn("gen", ["generator", "--help"])
    assert child.wait_or_kill(60) == -signal.SIGTERM
    assert forks.broken and not forks.alive
    late = forks.spawn("gen", ["generator", "--help"])  # asked after it died: exited at once, never raises
    assert late.returncode == -signal.SIGTERM
    forks.close()


def test_a_server_that_forked_nothing_is_discarded_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """`tokenpipe up` starts its server before it knows whether a generator will be forked; when none is, the
    supervisor discards it: stopped mid-import, not left to finish importing torch, and no failure logged."""
    forks = ForkServer()
    forks.discard()
    assert not forks.alive and forks.proc.returncode == -signal.SIGTERM
    assert not forks.broken and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_up_that_fails_before_its_supervisor_runs_leaves_no_fork_server(tmp_path: Path) -> None:
    """`tokenpipe up` starts its fork server before it reads its settings: a bad one ends the command, and the
    server with it (its parent-death signal)."""
    mark = uuid.uuid4().hex
    up = subprocess.run([str(Path(sys.executable).parent / "tokenpipe"), "up", "--data-dir", str(tmp_path)],
                        env={**os.environ, "TOKENPIPE_PORT": "not-a-port", "TOKENPIPE_TEST_MARK": mark},
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "TOKENPIPE_PORT" in up.stderr, up.stderr

    def marked() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and f"TOKENPIPE_TEST_MARK={mark}".encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:  # gone, or not ours to read
                continue
        return found

    deadline = time.monotonic() + 30
    while marked() and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a condition, bounded by the deadline
    assert marked() == []
