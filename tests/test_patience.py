"""A generator waits out JetStream being unavailable instead of spending delivery attempts.

Regression: a stream stalled for ever after a NATS node was frozen for 10 s (the SIGSTOP
cluster test, about one run in four). Every failed history read handed the request back with a
nak, which spends one of its ``max_deliver`` (3) attempts; a delivery lost with the frozen
node, then two reads failing while TP_TOKENS elected a leader, used them all, and the
max-deliveries handler, whose own history read failed the same way, gave up silently: nobody
ended the client's stream. :func:`generator.service.intake.patiently` now retries such reads (keeping
the delivery), and the handler retries through elections.
"""

from __future__ import annotations

import time

import pytest

from generator.service.intake import patiently
from tokenpipe.errors import TransportError


async def test_history_read_failing_during_an_election_is_retried_not_handed_back() -> None:
    calls: list[float] = []

    async def read() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise TransportError("could not read stream history: nats: timeout")
        return "history"

    assert await patiently(read, what="reading history", request_id="r1", patience_s=10) == "history"
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.25 and calls[2] - calls[1] >= 0.5  # backing off, not spinning


async def test_patience_ends_with_the_last_error() -> None:
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        raise TransportError(f"still no leader ({calls})")

    t0 = time.monotonic()
    with pytest.raises(TransportError, match="still no leader"):
        await patiently(read, what="reading history", request_id="r1", patience_s=1.0)
    assert calls >= 2
    assert time.monotonic() - t0 < 5  # bounded by its patience, not by the op


async def test_other_errors_are_not_retried() -> None:
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        await patiently(read, what="reading history", request_id="r1", patience_s=10)
    assert calls == 1
