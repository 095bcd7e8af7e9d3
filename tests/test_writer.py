"""A request's output path held until its stream id is checked (generator.service.writer), as pure logic:
the publisher here records instead of talking to NATS (the end-to-end refusal is in test_pipeline)."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from generator.engine.handle import Emission
from generator.service.publisher import BatchPublisher
from generator.service.writer import OutputContext, StreamWriter
from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.settings import Settings
from tokenpipe.wire import Request, TokenBatch, Usage


class Recorder(BatchPublisher):
    """What would have been published, and acked, in order."""

    def __init__(self) -> None:  # no bus: nothing is sent
        self.out: list[tuple[str, Any]] = []

    def publish(self, chain: Any, data: bytes, headers: dict[str, str]) -> None:
        self.out.append(("batch", TokenBatch.decode(data)))

    def ack_after_published(self, chain: Any, msg: Any) -> None:
        self.out.append(("ack", msg))


def _output(*, cleared: bool) -> tuple[StreamWriter, Recorder, list[TokenBatch]]:
    recorder, finished = Recorder(), []
    ctx = OutputContext(Settings(), recorder, GeneratorMetrics("m"), trace.NoOpTracer(),
                        lambda _out, batch: finished.append(batch), lambda _out, _exc: None)
    request = Request.build("m", prompt="p", params={"max_tokens": 2})
    span = trace.NoOpTracer().start_span("generate")
    out = StreamWriter(ctx, request, "the-msg", span, received=time.time_ns(), cleared=cleared)  # type: ignore[arg-type]
    return out, recorder, finished


def _run(out: StreamWriter) -> None:
    rid, now = out.request.id, time.time_ns()
    out.emit(Emission(rid, (5,), "a", now, admitted_ns=now))
    out.emit(Emission(rid, (6,), "b", now + 1, finish="length", usage=Usage(1, 2)))


async def test_held_batches_go_out_in_order_with_the_ack_last_once_cleared() -> None:
    out, recorder, finished = _output(cleared=False)
    _run(out)  # the request finished before the check answered
    assert recorder.out == [] and finished == []
    out.clear()
    assert [kind for kind, _ in recorder.out] == ["batch", "batch", "ack"]
    assert [b.token_ids for _, b in recorder.out[:2]] == [(5,), (6,)]
    assert len(finished) == 1 and finished[0].is_final


async def test_a_refused_request_that_already_finished_publishes_nothing_and_is_done() -> None:
    out, recorder, finished = _output(cleared=False)
    _run(out)
    out.refuse()
    assert recorder.out == [] and len(finished) == 1 and out.refused


async def test_a_refused_running_request_is_done_at_its_final_emission_unpublished() -> None:
    out, recorder, finished = _output(cleared=False)
    rid, now = out.request.id, time.time_ns()
    out.emit(Emission(rid, (5,), "a", now, admitted_ns=now))
    out.refuse()
    assert finished == []  # the engine still holds it: the slot is not free yet
    out.emit(Emission(rid, (), "", now + 1, finish="cancelled", usage=Usage(1, 1)))
    assert recorder.out == [] and len(finished) == 1


async def test_a_redelivery_is_not_held_and_publishes_at_once() -> None:
    out, recorder, _ = _output(cleared=True)
    out.emit(Emission(out.request.id, (5,), "a", time.time_ns(), admitted_ns=time.time_ns()))
    assert [kind for kind, _ in recorder.out] == ["batch"]
