"""`tokenpipe up` as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from producer import SSEParser
from tokenpipe_cli.launch import LaunchError, free_port, spawn, wait_ready

# The console script that `make install` puts beside this interpreter, as a user runs it.
TOKENPIPE = str(Path(sys.executable).parent / "tokenpipe")


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(240)
def test_up_serves_a_stream_and_stops_cleanly_on_sigterm(tmp_path: Path, data_dir: Path) -> None:
    port, nats_port = free_port(), free_port()
    env = {**os.environ, "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.5", "TOKENPIPE_LOG_LEVEL": "INFO"}
    # The model cache is shared with the other tests so this test does not convert SmolLM2 again.
    (tmp_path / "models").symlink_to(data_dir / "models", target_is_directory=True)
    proc = subprocess.Popen(
        [TOKENPIPE, "up", "--model", "tiny-random", "--port", str(port),
         "--nats-port", str(nats_port), "--data-dir", str(tmp_path), "--generators", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "tokenpipe is up" in line:
                break
        else:
            raise AssertionError("tokenpipe up exited early:\n" + "".join(lines))
        assert f"http://127.0.0.1:{port}" in lines[-1]
        status = json.loads((tmp_path / "up.json").read_text())
        assert status["state"] == "up" and status["ports"]["relay"] == port and status["ports"]["nats"] == nats_port
        assert {r["name"] for r in status["roles"]} == {"nats-server", "generator-0", "generator-1", "relay"}
        assert all(r["pid"] in _children(proc.pid) for r in status["roles"])
        descendants = _children(proc.pid)
        assert len(descendants) >= 4  # nats-server, 2 generators, relay
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.get("/readyz").status_code == 200
            sid = c.post("/v1/streams", json={"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}).json()["id"]
            parser = SSEParser()
            with c.stream("GET", f"/v1/streams/{sid}") as resp:
                data = [event.json() for chunk in resp.iter_bytes() for event in parser.feed(chunk)]
        assert data[-1]["finish"] == "length" and data[-1]["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in descendants) and time.monotonic() < deadline:
            time.sleep(0.1)  # processes are reaped asynchronously by their parent's exit
        assert not [p for p in descendants if _alive(p)], "orphan processes left behind"
        status = json.loads((tmp_path / "up.json").read_text())
        assert status["state"] == "stopped" and {r["state"] for r in status["roles"]} == {"stopped"}
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_the_launcher_names_a_child_that_exits_before_it_is_ready(tmp_path: Path) -> None:
    child = spawn("doomed", [sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"],
                  log=tmp_path / "doomed.log")
    with pytest.raises(LaunchError, match=r"doomed \(log: .*doomed.log\) exited with 3 while waiting for the relay"):
        wait_ready(lambda: False, timeout=30, what="the relay", children=[child], interval=0.01)
    assert "bad config" in (tmp_path / "doomed.log").read_text()


def test_the_launcher_times_out_clearly_and_stops_what_it_started() -> None:
    child = spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(LaunchError, match=r"the relay not ready within 0\.2s"):
            wait_ready(lambda: False, timeout=0.2, what="the relay", children=[child], interval=0.01)
        assert child.returncode is None
    finally:
        assert child.stop(timeout=10) == -signal.SIGTERM
