"""The one retry policy (tokenpipe.retry), on an injected clock: what is retried, for how long, how far apart."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
import pytest

from tokenpipe.errors import InvalidRequest, StreamNotFound, TransportError, WireFormatError
from tokenpipe.retry import Backoff, Retry, retrying, transient


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def failing(errors: list[BaseException], result: str = "ok") -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def op() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return calls, op


@pytest.mark.parametrize("exc", [
    TransportError("no leader"), nats.js.errors.NoStreamResponseError(), nats.errors.NoRespondersError(),
    nats.errors.TimeoutError(), TimeoutError(), ConnectionResetError(),
    nats.js.errors.APIError(code=503, description="unavailable"),
    nats.js.errors.APIError(code=409, description="duplicate message id is in process"),
])
def test_transient_failures_mean_not_now(exc: BaseException) -> None:
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    WireFormatError("not msgpack"), InvalidRequest("bad"), StreamNotFound("gone"), ValueError("a bug"),
    nats.js.errors.BadRequestError(code=400, description="no"), nats.js.errors.KeyNotFoundError(),
    nats.js.errors.APIError(code=409, description="wrong last sequence"),
])
def test_refusals_bugs_and_malformed_data_are_final(exc: BaseException) -> None:
    assert not transient(exc)


async def test_transient_errors_are_retried_with_growing_delays_until_success() -> None:
    t = FakeTime()
    calls, op = failing([TransportError("a")] * 4)
    got = await retrying(op, Retry(budget_s=10, first_delay_s=0.1, max_delay_s=0.5), what="read",
                         clock=t.clock, sleep=t.sleep)
    assert got == "ok" and len(calls) == 5
    assert t.slept == [0.1, 0.2, 0.4, 0.5]


async def test_the_budget_bounds_the_operation_and_the_last_error_is_raised() -> None:
    t = FakeTime()
    calls, op = failing([TransportError(f"try {i}") for i in range(100)])
    with pytest.raises(TransportError, match="try 3"):
        await retrying(op, Retry(budget_s=2.0, first_delay_s=0.25, max_delay_s=1.0), what="read",
                       clock=t.clock, sleep=t.sleep)
    assert t.slept == [0.25, 0.5, 1.0]  # the next 1.0 would end past the 2 s budget
    assert len(calls) == 4 and t.now <= 2.0


async def test_malformed_data_is_never_retried() -> None:
    """Regression: ``patiently`` retried a corrupt batch (WireFormatError, a TokenpipeError) for 30 s."""
    t = FakeTime()
    calls, op = failing([WireFormatError("not msgpack")])
    with pytest.raises(WireFormatError):
        await retrying(op, Retry(budget_s=30), what="read", clock=t.clock, sleep=t.sleep)
    assert len(calls) == 1 and t.slept == []


async def test_between_runs_before_each_pause() -> None:
    t = FakeTime()
    kept: list[float] = []

    async def keep() -> None:
        kept.append(t.now)

    calls, op = failing([TransportError("a"), TransportError("b")])
    await retrying(op, Retry(budget_s=10, first_delay_s=1, max_delay_s=1), what="read",
                   between=keep, clock=t.clock, sleep=t.sleep)
    assert kept == [0.0, 1.0] and len(calls) == 3


async def test_each_attempt_is_bounded_when_the_policy_says_so() -> None:
    import asyncio

    calls: list[int] = []

    async def hangs_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.Event().wait()  # a request to a server that died: no answer ever
        return "ok"

    assert await retrying(hangs_once, Retry(budget_s=10, first_delay_s=0.01, attempt_timeout_s=0.05),
                          what="read") == "ok"
    assert len(calls) == 2


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(0.05, 0.3)
    assert [b.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    b.reset()
    assert b.next() == 0.05


def test_regression_an_immediate_backoff_sends_what_failed_during_an_outage_at_once_after_it() -> None:
    """The publisher's confirm loop once paused 50 ms before republishing each batch that failed
    during a leader election, even after JetStream answered again: hundreds of batches were held
    back for tens of seconds and the relays' readers declared them lost (the fault tests)."""
    b = Backoff(0.05, 1.0, immediate=True)
    assert [b.next() for _ in range(4)] == [0.0, 0.05, 0.1, 0.2]
    b.reset()  # a batch was confirmed: JetStream answers again
    assert b.next() == 0.0
