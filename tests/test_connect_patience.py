"""A role's start-up provisioning waits out a JetStream that does not answer in time.

Regression: a role exited when its first stream request to JetStream timed out ("JetStream
provisioning failed: nats: timeout"), after loading its model, as on a 3-node cluster that had
just formed. A CI run's cluster-fault module errored on every test waiting 90 s for its
generators; this is the one way found for a generator to never get ready there. The server here
is frozen (SIGSTOP) past the JetStream API timeout, then thawed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tokenpipe.bus import _provision_patiently, connect
from tokenpipe.errors import TransportError
from tokenpipe.settings import Settings
from tokenpipe_cli.natsserver import NatsServer

from .conftest import freeze

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def frozen(pid: int, seconds: float) -> Iterator[None]:
    """nats-server ``pid`` stopped (SIGSTOP) now and thawed ``seconds`` later, or when the block ends."""
    freeze(pid)
    thaw = asyncio.get_running_loop().call_later(seconds, os.kill, pid, signal.SIGCONT)
    try:
        yield
    finally:
        thaw.cancel()
        os.kill(pid, signal.SIGCONT)


async def test_provisioning_that_times_out_while_jetstream_is_frozen_is_retried_until_it_answers(
        tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        settings = Settings.load(env={}, nats_url=server.url)
        bus = await connect(settings, name="patience-test")
        assert server.pid is not None
        try:
            t0 = time.monotonic()
            with frozen(server.pid, 12.0):  # longer than one try's timeout (the JetStream context's 10 s)
                await _provision_patiently(bus.js, settings, registry=True, replicas=1)
            assert time.monotonic() - t0 >= 12.0  # it waited for the thaw, it did not skip the work
            assert "TP_REQUESTS" in [s.config.name for s in await bus.js.streams_info()]
        finally:
            await bus.close()


async def test_a_refusal_is_raised_at_once_not_retried(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        settings = Settings.load(env={}, nats_url=server.url)
        nc = await nats.connect(server.url)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="replicas"):
                # Three replicas on one server: JetStream refuses, and would refuse again.
                await _provision_patiently(nc.jetstream(timeout=10), settings, registry=True, replicas=3)
            assert time.monotonic() - t0 < 10
        finally:
            await nc.close()


async def test_a_generators_placement_slots_are_made_after_a_frozen_jetstream_answers(tmp_path: Path) -> None:
    """Regression (CI, 12-07): on a cluster that had just formed a generator exited with "JetStream did
    not answer ['INFO', 'TP_REQUESTS']" while making its placement slots' consumers (5 s a try), after
    its streams were provisioned patiently; the cluster-fault module then errored on every test."""
    from generator.service.placed import SlotPulls
    from tokenpipe.subjects import slot_consumer_name

    with NatsServer(tmp_path / "nats") as server:
        settings = Settings.load(env={}, nats_url=server.url, placement_slots=2)
        bus = await connect(settings, name="patience-slots")

        async def deliver(msgs: list[object]) -> None:
            raise AssertionError("nothing is placed here")

        pulls = SlotPulls(bus, settings, model="tiny-random", slot=0, room=lambda: 0, wanted_own=lambda: 0,
                          deliver=deliver)  # type: ignore[arg-type]
        assert server.pid is not None
        try:
            t0 = time.monotonic()
            with frozen(server.pid, 7.0):  # longer than one ask's 5 s: a single try fails
                await pulls.start()
            assert time.monotonic() - t0 >= 7.0
            for slot in range(2):
                info = await bus.js.consumer_info("TP_REQUESTS", slot_consumer_name("tiny-random", slot))
                assert info.config.filter_subject is not None
        finally:
            await pulls.stop()
            await bus.close()
