"""The Batch API's record store (:mod:`relay.batchdb`) against a real nats-server that goes away
and comes back: a read waits out the outage instead of failing the client's request."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from relay.batchdb import BatchDB
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe_cli.natsserver import NatsServer

pytestmark = pytest.mark.timeout(120)


async def test_a_record_read_while_the_relays_nats_node_restarts_after_kill9_is_answered_not_503(
        tmp_path: Path) -> None:
    # The bug: a client polling its batch got a 503 ("could not read the Batch API's records") from a
    # relay whose NATS node was killed, while the cluster elected the bucket's new leader.
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await connect(Settings.load(env={}, nats_url=server.url), name="batchdb-test")
        try:
            db = BatchDB(lambda: bus)
            stored = await db.put_file("alice", "night.jsonl", "batch", b'{"custom_id": "a"}\n', 3600)
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            server.child = None
            # Back after 3 s on the same port and store: the read below starts while nothing listens.
            restart = asyncio.get_running_loop().call_later(3.0, server.spawn)
            try:
                read = await db.file("alice", stored.id)
            finally:
                restart.cancel()
            assert read == stored
            assert [f.id for f in await db.files("alice")] == [stored.id]
        finally:
            await bus.close()
    finally:
        server.stop()
