"""Fixtures with real parts: a nats-server subprocess, the engine, uvicorn, httpx."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
import uvicorn

from generator.model.loader import LoadedModel, load_model
from generator.model.preparation import SMOLLM2, _complete, prepare_smollm2
from generator.service.worker import GeneratorWorker
from producer import aiter_sse
from relay.app import create_app
from relay.connections import server_options
from tokenpipe.bus import Bus, connect
from tokenpipe.settings import Settings
from tokenpipe_cli.launch import free_port
from tokenpipe_cli.natsserver import NatsServer

ROOT = Path(__file__).resolve().parent.parent


def run_bench(args: list[str], timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` from the repository root (bench/ is not installed: its modules run from there)."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
# The converted SmolLM2 cache outlives one run (it takes ~20 s to build); CI starts from nothing.
MODEL_CACHE = Path(os.environ.get("TOKENPIPE_TEST_DATA_DIR", ROOT / ".tokenpipe" / "test-data"))


# The suite runs on two pytest-xdist workers, a test module at a time on one of them (--dist loadfile:
# module-scoped stacks are built once; the session's in-process stack once per worker). The longest
# modules start first (seconds each, measured with the suite on two workers on 2 cores), so that none is
# left to run alone at the end; the rest follow in collection order (--no-loadscope-reorder keeps it).
# Not three: 473 s against 542 s warm, but in a fresh clone the chaos test (a 3-node cluster under faults)
# then ran past its 300 s bound while the SmolLM2 conversion and two other stacks shared the cores.
_LONGEST_FIRST = ("test_kernel_install.py",  # compiles the library twice (~190 s on a busy 2-core machine)
                  "test_cluster_faults.py", "test_chaos.py", "test_heal.py", "test_bench.py",  # 130-88 s
                  "test_resilience.py", "test_kernels.py", "test_natsauth_tenants.py", "test_cluster.py",  # 72-41 s
                  "test_schema.py", "test_engineproc.py", "test_smollm2.py", "test_edge_defects.py",  # 36-30 s
                  "test_packaging.py", "test_engine.py", "test_kvcache.py", "test_cluster_relays.py")  # 31-22 s


def _rank(item: pytest.Item) -> int:
    name = item.nodeid.split("::", 1)[0].rpartition("/")[2]
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each module keeps its tests' order


async def wait_until(cond: Callable[[], Awaitable[bool] | bool], timeout: float = 30.0,
                     what: str = "condition") -> None:
    """Poll ``cond`` until true; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block, as the tests' generator processes run
    (``TOKENPIPE_THREADS=1``): a greedy reference computed in this process is then what they compute.
    It is also ~10x faster on a busy 2-core machine (1,500 tiny-random tokens: 2.8 s, against 26-37 s
    with two threads, whose OpenMP team waits for whichever thread lost its core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Preparation:
    """Two processes that prepared SmolLM2 at once in one data dir, as generators started together by
    hand on a fresh one do: the dir, and each process's exit code, stdout and stderr."""

    data_dir: Path
    procs: list[tuple[int, str, str]]


def prepare_together(data: Path) -> Preparation:
    """:func:`~generator.model.preparation.prepare_smollm2` in two processes started together on ``data``."""
    code = "import sys; from generator.model.preparation import prepare_smollm2; print(prepare_smollm2(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(data)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    return Preparation(data, [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)])


@pytest.fixture(scope="session")
def cache_preparation() -> Preparation | None:
    """Where the test cache lacks SmolLM2 (CI starts from nothing), its conversion done by two processes
    at once: the conversion every test needs and the one the regression test of two generators on a
    fresh data dir checks (test_smollm2.py) are then one, not two (each ~20 s, more on a busy 2-core
    machine). None where the cache is ready: that test then converts into a directory of its own.

    Under pytest-xdist every worker asks: the first does the conversion under a lock and leaves what its
    two processes said for the others of the same run, so each worker's test sees that one conversion."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    record = MODEL_CACHE / f".preparation-{run}.json"
    with (MODEL_CACHE / ".preparation.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if run and record.exists():
            seen = json.loads(record.read_text())
            return None if seen is None else Preparation(Path(seen["data_dir"]),
                                                         [(int(c), str(o), str(e)) for c, o, e in seen["procs"]])
        prep = None if _complete(MODEL_CACHE / "models" / SMOLLM2) else prepare_together(MODEL_CACHE)
        if run:
            for old in MODEL_CACHE.glob(".preparation-*.json"):  # earlier runs'
                old.unlink(missing_ok=True)
            record.write_text(json.dumps(None if prep is None else
                                         {"data_dir": str(prep.data_dir), "procs": prep.procs}))
        return prep


@pytest.fixture(scope="session")
def data_dir(cache_preparation: Preparation | None) -> Path:
    """A data dir whose model cache is ready (converted once per checkout, ~20 s)."""
    prepare_smollm2(MODEL_CACHE)  # nothing to do after cache_preparation, unless it failed (its test says how)
    return MODEL_CACHE


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def settings(nats_server: NatsServer, data_dir: Path) -> Settings:
    return Settings.load(
        env={},
        nats_url=nats_server.url,
        data_dir=str(data_dir),
        model="tiny-random",
        max_batch=8,
        max_seq_len=2048,
        coalesce_max_tokens=4,
        coalesce_max_delay_ms=20.0,
        announce_interval_s=0.5,
        keepalive_s=1.0,
        drain_timeout_s=2.0,
        dtype="float32",  # exact comparisons with in-process references; bf16 is covered on its own
    )


@pytest.fixture(scope="session")
def tiny_model(data_dir: Path) -> LoadedModel:
    return load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)


@pytest.fixture(scope="session")
def smollm2(data_dir: Path) -> LoadedModel:
    return load_model("smollm2-135m", device="cpu", dtype="float32", data_dir=data_dir)


@pytest.fixture(scope="session")
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    b = await connect(settings, name="tests")
    yield b
    await b.close()


@pytest.fixture(scope="session")
async def generator(settings: Settings, data_dir: Path) -> AsyncIterator[GeneratorWorker]:
    """A real worker on the tiny model (its own model instance: the engine thread owns it). Its engine
    steps on one torch thread, as the tests' generator processes do: with two, a step on the busy 2-core
    machine waits for whichever OpenMP thread lost its core (the schemathesis run: 40 s -> 31 s)."""
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    b = await connect(settings, name="test-generator")
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-engine",
                                       initializer=torch.set_num_threads, initargs=(1,))
    worker = GeneratorWorker(settings, loaded, b, torch_thread=engine_thread)
    await worker.start()
    yield worker
    await worker.stop(drain_timeout=1.0)
    await b.close()
    engine_thread.shutdown(wait=False)


@contextlib.contextmanager
def engine_held_after(worker: GeneratorWorker, steps: int,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """``worker``'s engine runs ``steps`` steps with work, then each next step waits until the yielded event is
    set (60 s at most): a test holds a stream mid-way however fast the machine generates. Set on exit."""
    engine, release = cast(Any, worker.runner).engine, threading.Event()  # the in-process runner's
    step, done = engine.step, 0

    def held() -> Any:
        nonlocal done
        done += 1
        if done > steps:
            release.wait(60)
        return step()

    monkeypatch.setattr(engine, "step", held)
    try:
        yield release
    finally:
        release.set()


class RelayServer:
    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        options = server_options(app.state.relay.settings)  # the header timeout and keepalives relay.main runs with
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                                    access_log=False, timeout_graceful_shutdown=1, **options))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> RelayServer:
        self.task = asyncio.create_task(self.server.serve())
        await wait_until(lambda: self.server.started, 20, "uvicorn to start")
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def start_relay(settings: Settings, ready_headers: dict[str, str] | None = None, **kw: Any) -> RelayServer:
    app = create_app(settings.replace(port=free_port()), **kw)
    relay = await RelayServer(app, free_port()).start()

    async def ready() -> bool:
        async with httpx.AsyncClient(headers=ready_headers) as c:
            return (await c.get(relay.url + "/readyz")).status_code == 200

    await wait_until(ready, 30, "relay /readyz")
    return relay


@pytest.fixture(scope="session")
async def relay(settings: Settings, generator: GeneratorWorker) -> AsyncIterator[RelayServer]:
    server = await start_relay(settings)
    yield server
    await server.stop()


@pytest.fixture
async def http(relay: RelayServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=relay.url, timeout=60) as client:
        yield client


async def read_sse(response: httpx.Response) -> list[tuple[str, str | None, str]]:
    """Parse an SSE response into (event, id, data) triples, comments dropped."""
    return [(e.event, e.id, e.data) async for e in aiter_sse(response)]


def stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` (or ``…/task/<tid>/stat``) after the command name: [state, ppid, …].
    The name is cut at its last ")", since it may hold spaces and parentheses itself."""
    return stat.read_text().rsplit(")", 1)[1].split()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. The signal is asynchronous: a thread
    running on another CPU stops at its next entry into the kernel, and a frozen nats-server answered a
    whole provisioning (streams, buckets: 3.5 ms) after ``kill`` had returned (a CI-like busy run)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = Path("/proc") / str(pid) / "task"
    while True:
        states = []
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):  # a thread that just exited
                states.append(stat_fields(task / "stat")[0])
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)  # polling the kernel's view of the process, bounded by the deadline


def parent_of(pid: int) -> int:
    """``pid``'s parent (from /proc)."""
    return int(stat_fields(Path("/proc") / str(pid) / "stat")[1])


def forked_by_fork_server(pids: list[int]) -> bool:
    """Whether every one of ``pids`` is a child of one ``tokenpipe up`` fork server (tokenpipe_cli.forkserver)."""
    parents = {parent_of(pid) for pid in pids}
    cmdline = (Path("/proc") / str(parents.pop()) / "cmdline").read_bytes() if len(parents) == 1 else b""
    return b"tokenpipe_cli.forkserver" in cmdline


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(stat_fields(entry / "stat")[1])
        except OSError:
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = stat_fields(Path(f"/proc/{pid}/stat"))[0]
    except OSError:
        return False
    return state != "Z"


def read_until_up(proc: subprocess.Popen[str]) -> str:
    """Read ``tokenpipe up``'s output (a text pipe) up to its "tokenpipe is up" line, and return
    that line; fail with everything it printed if it exits first."""
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "tokenpipe is up" in line:
            return line
    raise AssertionError("tokenpipe up exited early:\n" + "".join(lines))
