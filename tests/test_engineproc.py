"""The engine-core process (generator.engine.process, generator.engine.child): the engine in a child process of
the generator.

Its tokens are the in-process engine's; its death takes the generator down (the supervisor
restarts both) and its requests continue on another generator, checked through `tokenpipe up`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from generator.engine.handle import Emission, Job
from generator.engine.process import EngineProcess, use_engine_process
from generator.model.loader import LoadedModel
from tokenpipe.errors import ConfigError, GenerationError
from tokenpipe.settings import Settings
from tokenpipe.wire import Request
from tokenpipe_cli.upprocess import UpProcess

from .conftest import wait_until
from .test_heal import LONG, reference, running_stack, stream
from .test_resilience import _greedy_ids, assert_contiguous

pytestmark = pytest.mark.timeout(240)


def test_auto_is_on_with_cuda_and_off_on_cpu() -> None:
    assert use_engine_process("auto", "cpu") is False
    assert use_engine_process("auto", "cuda:1") is True
    assert use_engine_process("on", "cpu") is True
    assert use_engine_process("off", "cuda") is False
    with pytest.raises(ConfigError):
        use_engine_process("maybe", "cpu")


def _request(i: int, max_tokens: int) -> Request:
    return Request.from_map({"v": 1, "id": f"r{i}", "model": "tiny-random", "prompt": f"tell me {i} things",
                             "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})


def test_engine_process_streams_the_in_process_engines_tokens_and_dies_loudly(
        settings: Settings, tiny_model: LoadedModel) -> None:
    emitted: dict[str, list[Emission]] = {}
    finished = threading.Event()
    exits: list[int | None] = []
    died = threading.Event()

    def on_emit(ems: list[Emission]) -> None:
        for em in ems:
            emitted.setdefault(em.request_id, []).append(em)
        if sum(1 for v in emitted.values() if v[-1].finish) == 3:
            finished.set()

    def on_exit(code: int | None) -> None:
        exits.append(code)
        died.set()

    steps: list[int] = []
    engine = EngineProcess(dataclasses.replace(settings, threads=1), on_emit,
                           on_step=steps.append, on_exit=on_exit)
    try:
        assert engine.load()["name"] == "tiny-random"
        room = engine.memory_room
        requests = [_request(i, 12 + 5 * i) for i in range(3)]
        for i, req in enumerate(requests):
            engine.submit(Job(req, more_coming=i < 2))
        # Counted as soon as they are handed over (nothing is drained before start: no report yet).
        assert engine.memory_room == room - 3
        engine.start()
        assert finished.wait(120), emitted
        for req in requests:
            ems = emitted[req.id]
            tokens = [t for em in ems for t in em.token_ids]
            assert tokens == _greedy_ids(tiny_model, req)
            assert ems[-1].finish == "length" and ems[-1].usage is not None
            assert ems[-1].usage.completion_tokens == req.params.max_tokens
            assert ems[0].admitted_ns > 0
        assert steps and max(steps) >= 2  # the step observer saw the batch
        assert engine.stats().blocks_capacity > 0 and engine.running == 0
        # kill -9 of the engine-core process: the generator is told, and nothing is sent to the dead
        assert engine.process is not None
        engine.process.kill()
        assert died.wait(30)
        assert exits == [-signal.SIGKILL]
        engine.cancel("r0")  # a no-op: the request died with the engine
        with pytest.raises(GenerationError, match="gone"):
            engine.submit(Job(_request(9, 4)))
    finally:
        engine.stop()


def _engine_core_of(pid: int) -> int:
    """The engine-core child of generator ``pid`` (`python -m generator.engine.child`)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"generator.engine.child" in cmdline:
                return int(child)
    raise AssertionError(f"generator {pid} has no engine-core process")


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    async with running_stack(tmp_path_factory, data_dir, "enginecore", 2, TOKENPIPE_ENGINE_PROCESS="on") as s:
        yield s


async def test_kill9_of_the_engine_core_process_hands_its_stream_to_another_generator(
        stack: UpProcess, tiny_model: LoadedModel) -> None:
    await stack.wait_up()
    killed: list[tuple[int, int]] = []  # (generator, engine core)

    async def on_tokens(sid: str, n: int) -> None:
        if n >= 30 and not killed:
            pid = await stack.holder(sid)
            core = _engine_core_of(pid)
            os.kill(core, signal.SIGKILL)
            killed.append((pid, core))

    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        sid, events = await stream(http, LONG, on_tokens)
        assert killed, "the stream finished before its engine could be killed"
        assert events[-1][0] == "done" and events[-1][2]["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert assert_contiguous(events, LONG["max_tokens"]) == reference(tiny_model, LONG)
        out = stack.output()
        assert "the engine-core process died" in out
        assert f"continuing redelivered request request_id={sid}" in out
        # The supervisor restarted the generator, and with it a new engine-core process.
        await stack.wait_up()
        restarted = next(r for r in stack.status()["roles"] if r["restarts"] >= 1 and r["name"].startswith("generator"))
        assert restarted["pid"] != killed[0][0]
        await wait_until(lambda: _engine_core_of(restarted["pid"]) != killed[0][1], what="a new engine core")
        _, events = await stream(http, {**LONG, "max_tokens": 8})
        assert events[-1][0] == "done"
