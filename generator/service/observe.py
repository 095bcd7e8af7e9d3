"""The generator's per-request timeline → Prometheus observations and child spans.

The engine serves many requests per step, so per-request phases cannot be live spans on the
engine thread; instead the timeline is recorded as it happens and turned into spans with
explicit start/end times when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from tokenpipe.metrics import GeneratorMetrics
from tokenpipe.wire import TokenBatch

__all__ = ["Timeline"]


@dataclass
class Timeline:
    created: int
    received: int
    resumed_tokens: int = 0
    admitted: int = 0
    first_token: int = 0
    last_token: int = 0
    first_emit: int = 0
    last_emit: int = 0

    def on_token(self, m: GeneratorMetrics, at_ns: int) -> None:
        if self.first_token == 0:
            self.first_token = at_ns
            if self.resumed_tokens == 0 and self.created:
                m.labels(m.ttft).observe((at_ns - self.created) / 1e9)
        else:
            m.labels(m.itl).observe((at_ns - self.last_token) / 1e9)
        self.last_token = at_ns

    def on_batch(self, m: GeneratorMetrics, batch: TokenBatch, at_ns: int) -> None:
        if self.first_emit == 0:
            self.first_emit = at_ns
        else:
            m.labels(m.inter_batch).observe((at_ns - self.last_emit) / 1e9)
        self.last_emit = at_ns
        if batch.token_ids:
            m.labels(m.tokens_per_batch).observe(len(batch.token_ids))

    def finish(self, m: GeneratorMetrics, tracer: Tracer, span: Any, batch: TokenBatch) -> None:
        """Record the request's phases and close its consumer span."""
        if self.created:
            m.labels(m.queue).observe(max(0, self.received - self.created) / 1e9)
            m.labels(m.e2e).observe(max(0, self.last_emit - self.created) / 1e9)
            span.set_attribute("tokenpipe.queue_wait_ms", max(0, self.received - self.created) / 1e6)
        if self.admitted and self.first_token:
            m.labels(m.prefill).observe((self.first_token - self.admitted) / 1e9)
            m.labels(m.decode).observe((self.last_token - self.first_token) / 1e9)
            if self.resumed_tokens == 0 and self.created:
                span.set_attribute("tokenpipe.time_to_first_token_ms", (self.first_token - self.created) / 1e6)
        if batch.usage:
            m.labels(m.prompt_tokens).inc(batch.usage.prompt_tokens)
            m.labels(m.generation_tokens).inc(max(0, batch.usage.completion_tokens - self.resumed_tokens))
            span.set_attribute("gen_ai.usage.input_tokens", batch.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", batch.usage.completion_tokens)
        m.finished.labels(model_name=m.model, finished_reason=batch.finish or "").inc()
        if batch.finish == "error":
            m.errors.labels(model_name=m.model, kind=batch.error_code or "error").inc()
            span.set_status(trace.Status(trace.StatusCode.ERROR, batch.error or "error"))
        span.set_attribute("gen_ai.response.finish_reasons", [batch.finish or ""])
        span.set_attribute("tokenpipe.batches", batch.seq + 1)
        parent = trace.set_span_in_context(span)
        for name, start, end in (("prefill", self.admitted, self.first_token),
                                 ("decode", self.first_token, self.last_token),
                                 ("publish batches", self.first_emit, self.last_emit)):
            if start and end:
                child = tracer.start_span(name, context=parent, start_time=start)
                if name == "publish batches":
                    child.set_attribute("tokenpipe.batches", batch.seq + 1)
                child.end(end_time=end)
        span.end(end_time=max(self.last_emit, self.received))
