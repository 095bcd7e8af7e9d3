"""The application SDK: submit generation jobs over NATS, iterate their batches, cancel them.

    async with await Producer.connect("nats://127.0.0.1:4222") as p:
        handle = await p.submit("smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
        async for text in handle.text():
            print(text, end="", flush=True)
        result = await handle.result()
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from tokenpipe.bus import Bus, connect
from tokenpipe.errors import GenerationError
from tokenpipe.settings import Settings
from tokenpipe.streams import Gap, Ping, cancel, follow, paced, submit
from tokenpipe.subjects import check_model_name, request_subject
from tokenpipe.telemetry import get_tracer, producer_span
from tokenpipe.wire import Request, ServiceTier, TokenBatch, Usage

__all__ = ["Producer", "StreamHandle", "Result"]


@dataclass
class Result:
    """The whole of a finished stream."""

    id: str
    text: str
    token_ids: list[int]
    finish: str | None
    usage: Usage | None
    batches: int
    error: str | None = None
    gaps: list[Gap] = field(default_factory=list)


@dataclass
class StreamHandle:
    """One submitted stream. Iterate it once for batches, or await :meth:`result`."""

    id: str
    producer: Producer
    after_seq: int = -1
    speed: float | None = None  # replay pacing; None = live / as stored
    gaps: list[Gap] = field(default_factory=list)  # batches that will never arrive (expired or lost)
    _result: Result | None = field(default=None, repr=False)

    async def __aiter__(self) -> AsyncIterator[TokenBatch]:
        text: list[str] = []
        tokens: list[int] = []
        count = 0
        source = follow(self.producer.bus, self.id, after_seq=self.after_seq)
        async for item in (source if self.speed is None else paced(source, self.speed)):
            if isinstance(item, Ping):
                continue
            if isinstance(item, Gap):
                self.gaps.append(item)
                continue
            count += 1
            text.append(item.text)
            tokens.extend(item.token_ids)
            yield item
            if item.is_final:
                self._result = Result(self.id, "".join(text), tokens, item.finish, item.usage, count, item.error,
                                      list(self.gaps))

    async def text(self) -> AsyncIterator[str]:
        """Text deltas as they arrive."""
        async for batch in self:
            if batch.text:
                yield batch.text

    async def result(self) -> Result:
        """Wait for the end; raises :class:`GenerationError` if the stream ended in error."""
        if self._result is None:
            async for _ in self:
                pass
        assert self._result is not None
        if self._result.finish == "error":
            raise GenerationError(self._result.error or "generation failed")
        return self._result

    async def cancel(self) -> None:
        await self.producer.cancel(self.id)


class Producer:
    """Publishes requests to ``tp.req.<model>.<app>`` and follows ``tp.tok.<app>.<id>`` (the app is
    ``bus.owner``: its credentials' name, ``TOKENPIPE_APP_NAME``, or the relay's on an open bus)."""

    def __init__(self, bus: Bus, *, tenant: str = "default", tracer_provider: TracerProvider | None = None) -> None:
        self.bus = bus
        self.tenant = tenant
        self.tracer = get_tracer(tracer_provider or trace.NoOpTracerProvider())

    @classmethod
    async def connect(cls, nats_url: str | None = None, *, settings: Settings | None = None, tenant: str = "default",
                      tracer_provider: TracerProvider | None = None) -> Producer:
        settings = settings or Settings.load(nats_url=nats_url)
        bus = await connect(settings, name="tokenpipe-producer", role="app")
        return cls(bus, tenant=tenant, tracer_provider=tracer_provider)

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.bus.close()

    async def submit(self, model: str, *, prompt: str | None = None,
                     messages: Sequence[Mapping[str, str]] | None = None, input_ids: Sequence[int] | None = None,
                     coalesce: Mapping[str, Any] | None = None, request_id: str | None = None,
                     service_tier: ServiceTier = "auto", session: str | None = None,
                     **params: Any) -> StreamHandle:
        """Enqueue a job; ``params`` are sampling parameters (max_tokens, temperature, top_p, top_k,
        stop, seed, ignore_eos). ``service_tier="flex"`` marks batch work: generators serve waiting
        interactive requests (every other tier) first and preempt batch ones for them. ``session``
        (a conversation or end user) is an affinity hint: its requests go to the generator that holds
        their history's cache (tokenpipe.placement). Invalid values raise
        :class:`tokenpipe.errors.InvalidRequest`."""
        check_model_name(model)
        req = Request.build(model, prompt=prompt, messages=messages, input_ids=input_ids, params=params,
                            coalesce=coalesce, tenant=self.tenant, request_id=request_id, service_tier=service_tier,
                            session=session)
        with producer_span(self.tracer, request_subject(model, self.bus.owner),
                           {"gen_ai.request.model": model, "tokenpipe.stream.id": req.id}) as headers:
            await submit(self.bus, req, headers)
        return StreamHandle(req.id, self)

    def stream(self, stream_id: str, *, after_seq: int = -1) -> StreamHandle:
        """A handle on an existing stream (resume after ``after_seq``, or read from the start)."""
        return StreamHandle(stream_id, self, after_seq=after_seq)

    def replay(self, stream_id: str, *, speed: float = 1.0, after_seq: int = -1) -> StreamHandle:
        """A stream's history with its original pacing divided by ``speed`` (0 = as fast as possible),
        then live if it is still running. Iterating yields the same batches as the live stream."""
        return StreamHandle(stream_id, self, after_seq=after_seq, speed=speed)

    async def cancel(self, stream_id: str) -> None:
        await cancel(self.bus, stream_id)

