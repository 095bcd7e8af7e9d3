"""OpenTelemetry setup from the standard ``OTEL_*`` variables, and NATS-header propagation.

Nothing here touches global state at import time. :func:`setup_tracing` installs a
provider only when an exporter is configured, so tracing that is off costs a no-op
tracer. Tests pass their own provider (with an in-memory exporter) explicitly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Tracer, TracerProvider
from opentelemetry.util.types import AttributeValue

__all__ = ["setup_tracing", "inject_headers", "extract_context", "get_tracer", "trace_context_headers",
           "producer_span"]

_TRACE_KEYS = ("traceparent", "tracestate")

INSTRUMENTATION = "tokenpipe"


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider:
    """Return a tracer provider configured from ``OTEL_*``; a no-op one if tracing is off."""
    env = os.environ if env is None else env
    listed = env.get("OTEL_TRACES_EXPORTER", "").split(",")
    exporter_names = [e.strip() for e in listed if e.strip() not in ("", "none")]
    if not (exporter_names or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return trace.NoOpTracerProvider()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)})
    provider = SdkProvider(resource=resource)
    for name in exporter_names or ["otlp"]:
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _otlp_exporter(env)
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported (console, otlp, none)")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(env: Mapping[str, str]):  # type: ignore[no-untyped-def]
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    except ImportError as exc:
        raise ValueError(f"OTLP {protocol} exporter is not installed: pip install opentelemetry-exporter-otlp") from exc
    return OTLPSpanExporter()


def get_tracer(provider: TracerProvider) -> Tracer:
    return provider.get_tracer(INSTRUMENTATION)


def inject_headers(*, span: Span) -> dict[str, str]:
    """W3C trace context of ``span``, as NATS headers."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers


@contextlib.contextmanager
def producer_span(tracer: Tracer, subject: str,
                  attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[dict[str, str]]:
    """A PRODUCER span (messaging conventions) around publishing to ``subject``, current while
    the block runs; yields the NATS headers that carry its context to the consumer."""
    attrs: dict[str, AttributeValue] = {"messaging.system": "nats", "messaging.operation.type": "publish",
                                        "messaging.destination.name": subject, **(attributes or {})}
    with tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER, attributes=attrs) as span:
        yield inject_headers(span=span)


def trace_context_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Only the W3C trace-context entries of ``headers`` (a batch also carries ``Nats-Msg-Id``)."""
    return {k: v for k, v in headers.items() if k in _TRACE_KEYS}


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))
