"""`tokenpipe up` as a user runs it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from producer import SSEParser
from tokenpipe.settings import engine_threads
from tokenpipe_cli.launch import LaunchError, free_port, free_ports, spawn, wait_ready

from .conftest import alive, descendants, forked_by_fork_server, read_until_up

# The console script that `make install` puts beside this interpreter, as a user runs it.
TOKENPIPE = str(Path(sys.executable).parent / "tokenpipe")


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
    try:
        assert f"http://127.0.0.1:{port}" in read_until_up(proc)
        status = json.loads((tmp_path / "up.json").read_text())
        assert status["state"] == "up" and status["ports"]["relay"] == port and status["ports"]["nats"] == nats_port
        assert {r["name"] for r in status["roles"]} == {"nats-server", "generator-0", "generator-1", "relay"}
        assert all(r["pid"] in descendants(proc.pid) for r in status["roles"])
        children = descendants(proc.pid)
        assert len(children) >= 5  # nats-server, the fork server, 2 generators, relay
        # Both generators forked from the one process that imported torch and the engine (TOKENPIPE_FORK_GENERATORS).
        assert forked_by_fork_server([r["pid"] for r in status["roles"] if r["name"].startswith("generator")])
        base = f"http://127.0.0.1:{port}"
        # The machine's cores are shared out between the two generators, never two engines as wide as it.
        for mport in status["ports"]["metrics"]:
            # `up` is up with one generator ready; the other may still be loading (its /metrics is served
            # from the start, the engine's gauges once its worker exists): wait for that one's /readyz.
            deadline = time.monotonic() + 120
            while httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code != 200:
                assert time.monotonic() < deadline, f"the generator with metrics port {mport} never became ready"
                time.sleep(0.1)  # polling a condition, bounded by the deadline
            metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
            line = next(ln for ln in metrics.splitlines() if ln.startswith("tokenpipe_engine_threads{"))
            assert float(line.rsplit(" ", 1)[1]) == engine_threads(0, generators=2)
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.get("/readyz").status_code == 200
            sid = c.post("/v1/streams", json={"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}).json()["id"]
            parser = SSEParser()
            with c.stream("GET", f"/v1/streams/{sid}") as resp:
                data = [event.json() for chunk in resp.iter_bytes() for event in parser.feed(chunk)]
        assert data[-1]["finish"] == "length" and data[-1]["usage"]["completion_tokens"] == 8
        _check_bus_locked_down(tmp_path, nats_port, sid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)  # processes are reaped asynchronously by their parent's exit
        assert not [p for p in children if alive(p)], "orphan processes left behind"
        status = json.loads((tmp_path / "up.json").read_text())
        assert status["state"] == "stopped" and {r["state"] for r in status["roles"]} == {"stopped"}
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)


def _check_bus_locked_down(data: Path, nats_port: int, sid: str) -> None:
    """Authorization is on even on loopback: anonymous clients are refused; the credentials
    `up` made are private; the CLI finds its admin credentials in the data dir."""
    async def anonymous() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{nats_port}", allow_reconnect=False, max_reconnect_attempts=0,
                                connect_timeout=3)
        await nc.close()

    with pytest.raises(Exception, match=r"(?i)authorization"):
        asyncio.run(anonymous())
    creds = data / "creds"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o700
    assert {p.name for p in creds.iterdir()} >= {"relay.json", "generator.json", "admin.json", "app-default.json"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in creds.iterdir())
    assert stat.S_IMODE((data / "nats" / "nats-server.conf").stat().st_mode) == 0o600
    out = subprocess.run([TOKENPIPE, "streams", "--nats-url", f"nats://127.0.0.1:{nats_port}", "--data-dir", str(data)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and sid in out.stdout, out.stdout + out.stderr
    # The SDK (as app "default", its credentials found in the data dir) streams its own request.
    out = subprocess.run([TOKENPIPE, "submit", "hi", "--model", "tiny-random", "--raw", "--max-tokens", "4", "--json",
                          "--nats-url", f"nats://127.0.0.1:{nats_port}", "--data-dir", str(data)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["finish"] in ("length", "stop"), out.stdout


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


def test_a_cluster_node_found_its_monitoring_port_taken_by_an_outgoing_connection() -> None:
    """The ports chosen for servers lie outside the kernel's ephemeral range, where the local end
    of an outgoing connection cannot land between the choice and the server's bind."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(60)
    assert len(set(ports)) == 60
    assert not [p for p in ports if low <= p <= high], (low, high, ports)
    # ...and they are free: a listener binds each one.
    for port in ports[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_bench_coalescing_over_the_openai_api_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: it was a ValueError traceback, raised per request (after the whole --rate schedule)."""
    from tokenpipe_cli.cli import main

    argv = ["bench", "--api", "openai", "--model", "m", "--coalesce-max-tokens", "4",
            "--url", f"http://127.0.0.1:{free_port()}"]
    assert main([*argv, "--rate", "1", "--num-requests", "30"]) == 2
    assert "coalescing overrides need the native API or the SDK" in capsys.readouterr().err


def test_up_hands_its_log_json_and_external_nats_flags_to_the_roles(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `tokenpipe up --log-json --nats-url URL --nats-creds F --nats-ca CA` took the flags
    for itself alone: the generator and the relay it started logged key=value and connected
    without the credentials or the CA (only the environment reached them)."""
    from tokenpipe.settings import Settings
    from tokenpipe_cli.supervisor import Supervisor

    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr("tokenpipe_cli.supervisor.spawn_role",
                        lambda *args, name, **_: spawned.setdefault(name, list(args)))
    # Spawned, not forked: the flags are the same either way, and a fork server is a real process.
    settings = Settings.load(env={}, data_dir=str(tmp_path), port=free_port(), metrics_port=0, log_json=True,
                             nats_url="tls://10.0.0.9:4222", nats_creds="/secrets/app.json", nats_ca="/secrets/ca.pem",
                             fork_generators=False)
    sup = Supervisor(settings, external_nats=True)
    sup._build_roles()
    for role in sup.roles:
        role.start()
    assert sorted(spawned) == ["generator-0", "relay"]
    for args in spawned.values():
        assert "--log-json" in args
        assert args[args.index("--nats-creds") + 1] == "/secrets/app.json"
        assert args[args.index("--nats-ca") + 1] == "/secrets/ca.pem"
        assert "--nats-user" not in args and "--nats-cert" not in args


def test_up_gives_the_relay_its_model_as_the_default_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the relay `tokenpipe up --model tiny-random` started kept its own default model
    (smollm2-135m): while the generator was away (restarting), a request that named no model
    waited for smollm2-135m and was answered 404 instead of waiting for tiny-random."""
    from tokenpipe.settings import Settings
    from tokenpipe_cli.supervisor import Supervisor

    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr("tokenpipe_cli.supervisor.spawn_role",
                        lambda *args, name, **_: spawned.setdefault(name, list(args)))
    sup = Supervisor(Settings.load(env={}, data_dir=str(tmp_path), port=free_port(), metrics_port=0,
                                   model="tiny-random", fork_generators=False), external_nats=True)
    sup._build_roles()
    for role in sup.roles:
        role.start()
    relay = spawned["relay"]
    assert relay[relay.index("--model") + 1] == "tiny-random"


def test_a_generator_loads_first_and_connects_once_its_start_gate_exists(tmp_path: Path, data_dir: Path,
                                                                         nats_server: Any) -> None:
    """`tokenpipe up` starts its generators with NATS (TOKENPIPE_START_GATE): each loads its model while the
    streams are set up, and connects only once the gate file says they exist."""
    gate, ready, log = tmp_path / "streams.ready", tmp_path / "generator.ready", tmp_path / "generator.log"
    env = {**os.environ, "TOKENPIPE_START_GATE": str(gate), "TOKENPIPE_READY_FILE": str(ready),
           "TOKENPIPE_THREADS": "1", "TOKENPIPE_LOG_LEVEL": "INFO"}
    child = spawn("generator", [sys.executable, "-m", "tokenpipe_cli", "generator", "--model", "tiny-random",
                                "--nats-url", nats_server.url, "--data-dir", str(data_dir), "--metrics-port", "0"],
                  env=env, log=log)
    try:
        wait_ready(lambda: log.exists() and "waiting for the streams" in log.read_text(), timeout=120,
                   what="the generator's model loaded, waiting at the gate", children=[child])
        assert not ready.exists() and "nats connected" not in log.read_text()  # loaded, waiting at the gate
        gate.write_text("streams provisioned\n")
        wait_ready(ready.exists, timeout=60, what="the generator serving once the gate exists", children=[child])
        assert "nats connected" in log.read_text()
    finally:
        child.stop()


def test_a_generator_whose_metrics_port_was_taken_serves_another_and_names_it(tmp_path: Path, data_dir: Path,
                                                                              nats_server: Any) -> None:
    """Regression: two stacks on one host each found port 9101 free, and the generator that bound it second
    served without /metrics while up.json named 9101. It binds a free port instead and writes it beside
    its pid in the ready file `tokenpipe up` reads."""
    ready, log = tmp_path / "generator.ready", tmp_path / "generator.log"
    env = {**os.environ, "TOKENPIPE_READY_FILE": str(ready), "TOKENPIPE_THREADS": "1"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        child = spawn("generator", [sys.executable, "-m", "tokenpipe_cli", "generator", "--model", "tiny-random",
                                    "--nats-url", nats_server.url, "--data-dir", str(data_dir),
                                    "--metrics-port", str(port)], env=env, log=log)
        try:
            wait_ready(ready.exists, timeout=120, what="the generator serving", children=[child])
            pid, served = (int(v) for v in ready.read_text().split())
            assert pid == child.pid and served not in (0, port)
            assert "tokenpipe_engine_threads" in httpx.get(f"http://127.0.0.1:{served}/metrics").text
        finally:
            child.stop()


def test_up_names_the_metrics_port_a_generator_says_it_serves(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenpipe.settings import Settings
    from tokenpipe_cli.supervisor import Supervisor
    from tokenpipe_cli.uprole import read_status

    monkeypatch.setattr("tokenpipe_cli.supervisor.spawn_role", lambda *args, name, **_: None)
    wanted = free_port()
    sup = Supervisor(Settings.load(env={}, data_dir=str(tmp_path), port=free_port(), metrics_port=wanted),
                     external_nats=True)
    sup._build_roles()
    generator = next(r for r in sup.roles if r.name == "generator-0")
    generator.pid = 4242
    ready = tmp_path / "run" / "generator-0.ready"
    ready.write_text("4141 50123")  # a killed predecessor's
    assert not generator.ready_check() and sup._ports["metrics"] == [wanted]
    ready.write_text("4242 50124")
    assert generator.ready_check()
    assert sup._ports["metrics"] == [50124] and read_status(tmp_path)["ports"]["metrics"] == [50124]
