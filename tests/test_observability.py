"""One trace from the HTTP caller through NATS to the generator and back; metrics that move."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import start_http_server

from generator.model.loader import load_model
from generator.service.worker import GeneratorWorker
from tokenpipe.bus import connect
from tokenpipe.settings import Settings
from tokenpipe.telemetry import setup_tracing
from tokenpipe_cli.launch import free_port

from .conftest import read_sse, start_relay, wait_until

MODEL = "tiny-traced"  # its own model name, so only the traced generator serves these requests
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


@pytest.fixture(scope="module")
def provider(spans: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(spans))
    return p


@pytest.fixture(scope="module")
async def traced(settings: Settings, data_dir: Path, provider: TracerProvider) -> AsyncIterator[Any]:
    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = MODEL
    bus = await connect(settings, name="traced-generator")
    worker = GeneratorWorker(settings.replace(model=MODEL), loaded, bus, tracer_provider=provider)
    await worker.start()
    relay = await start_relay(settings.replace(model=MODEL), tracer_provider=provider)
    yield worker, relay
    await relay.stop()
    await worker.stop(drain_timeout=0.5)
    await bus.close()


def by_name(spans: list[ReadableSpan], prefix: str) -> ReadableSpan:
    found = [s for s in spans if s.name.startswith(prefix)]
    assert found, f"no span named {prefix!r} in {[s.name for s in spans]}"
    return found[-1]


def in_trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


async def test_one_trace_from_http_caller_to_generator_and_back(traced: Any, spans: InMemorySpanExporter) -> None:
    _, relay = traced
    async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
        r = await http.post("/v1/chat/completions", headers={"traceparent": CALLER},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}],
                                  "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    sid = r.headers["x-request-id"]
    tid = int(CALLER_TRACE, 16)
    await wait_until(lambda: any(s.name.startswith("POST") for s in in_trace(spans, tid)), 10, "server span")
    got = in_trace(spans, tid)
    server = by_name(got, "POST /v1/chat/completions")
    producer = by_name(got, "publish tp.req.")
    consumer = by_name(got, f"generate {MODEL}")
    forward = by_name(got, "forward ")
    assert server.kind == SpanKind.SERVER and server.parent is not None
    assert server.parent.span_id == 0x00F067AA0BA902B7  # the caller's trace continues
    assert producer.kind == SpanKind.PRODUCER and producer.parent.span_id == server.context.span_id
    assert consumer.kind == SpanKind.CONSUMER and consumer.parent.span_id == producer.context.span_id
    for phase in ("prefill", "decode", "publish batches"):
        assert by_name(got, phase).parent.span_id == consumer.context.span_id
    assert forward.parent.span_id == consumer.context.span_id  # batches carried the generation's context
    assert [e.name for e in forward.events] == ["first_batch", "last_batch"]
    a = consumer.attributes
    assert a["messaging.system"] == "nats" and a["messaging.destination.name"] == f"tp.req.{MODEL}.relay"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.usage.output_tokens"] == 12 and a["gen_ai.usage.input_tokens"] > 0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["tokenpipe.stream.id"] == sid and a["tokenpipe.batches"] >= 1
    assert "tokenpipe.time_to_first_token_ms" in a and "tokenpipe.queue_wait_ms" in a
    assert producer.attributes["messaging.system"] == "nats"


async def test_native_stream_forwarding_joins_the_submission_trace_and_replay_links(
        traced: Any, spans: InMemorySpanExporter) -> None:
    _, relay = traced
    async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
        sid = (await http.post("/v1/streams", json={"prompt": "x", "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True})).json()["id"]
        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            await read_sse(resp)
        async with http.stream("GET", f"/v1/streams/{sid}", params={"replay": "true", "speed": "0"}) as resp:
            await read_sse(resp)

    def find(prefix: str) -> ReadableSpan | None:
        return next((s for s in spans.get_finished_spans() if s.name == prefix + sid), None)

    await wait_until(lambda: find("replay ") is not None, 10, "replay span")
    forward, replay = find("forward "), find("replay ")
    assert forward is not None and replay is not None
    consumer = next(s for s in spans.get_finished_spans()
                    if s.name == f"generate {MODEL}" and s.attributes["tokenpipe.stream.id"] == sid)
    assert forward.context.trace_id == consumer.context.trace_id
    assert replay.context.trace_id != consumer.context.trace_id
    assert [link.context.trace_id for link in replay.links] == [consumer.context.trace_id]


async def test_regression_the_health_alias_was_traced_and_counted_as_route_other(
        traced: Any, spans: InMemorySpanExporter) -> None:
    """``/health`` (vLLM's and TGI's liveness path, an alias of ``/healthz``) got a server span and a
    ``route="other"`` request count on every probe; the probe paths are neither traced nor counted."""
    _, relay = traced
    series = 'tokenpipe_http_requests_total{route="other",status="200"}'

    def count(text: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))

    async with httpx.AsyncClient(timeout=30) as http:
        before = count((await http.get(relay.url + "/metrics")).text)
        for path in ("/health", "/healthz"):
            assert (await http.get(relay.url + path)).status_code == 200
        after = count((await http.get(relay.url + "/metrics")).text)
    assert after == before
    assert not [s.name for s in spans.get_finished_spans() if "health" in s.name or s.name.endswith(" other")]


async def test_metrics_expose_named_series_that_move(traced: Any) -> None:
    worker, relay = traced
    port = free_port()
    start_http_server(port, addr="127.0.0.1", registry=worker.metrics.registry)  # as `tokenpipe generator` does
    async with httpx.AsyncClient(timeout=30) as http:
        before_gen = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        before_relay = (await http.get(relay.url + "/metrics")).text
        r = await http.post(relay.url + "/v1/completions", json={"model": MODEL, "prompt": "count", "max_tokens": 9,
                                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        await wait_until(lambda: not worker.active, 10, "request to finish")
        after_gen = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        after_relay = (await http.get(relay.url + "/metrics")).text

    def value(text: str, series: str) -> float:
        for line in text.splitlines():
            if line.startswith(series + " ") or (line.startswith(series + "{") and line.split(" ")[0] == series):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    lab = f'{{model_name="{MODEL}"}}'
    for name in ("tokenpipe_time_to_first_token_seconds_count", "tokenpipe_inter_token_latency_seconds_count",
                 "tokenpipe_e2e_request_latency_seconds_count", "tokenpipe_request_queue_time_seconds_count",
                 "tokenpipe_request_prefill_time_seconds_count", "tokenpipe_request_decode_time_seconds_count",
                 "tokenpipe_tokens_per_published_batch_count", "tokenpipe_batch_size_count",
                 "tokenpipe_prompt_tokens_total"):
        assert value(after_gen, name + lab) > value(before_gen, name + lab), name
    assert value(after_gen, "tokenpipe_generation_tokens_total" + lab) - value(
        before_gen, "tokenpipe_generation_tokens_total" + lab) == 9
    finished = f'tokenpipe_request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert value(after_gen, finished) == value(before_gen, finished) + 1
    for name in ("tokenpipe_num_requests_running", "tokenpipe_num_requests_waiting", "tokenpipe_kv_cache_usage_perc",
                 "tokenpipe_inter_batch_latency_seconds_bucket", "tokenpipe_errors_total"):
        assert name in after_gen or name.replace("_total", "") in after_gen, name
    assert 'le="0.001"' in after_gen  # buckets down to 1 ms
    req = 'tokenpipe_http_requests_total{route="/v1/completions",status="200"}'
    assert value(after_relay, req) == value(before_relay, req) + 1
    assert value(after_relay, "tokenpipe_relay_batches_forwarded_total") > value(
        before_relay, "tokenpipe_relay_batches_forwarded_total")
    assert "tokenpipe_sse_active_connections" in after_relay
    assert "tokenpipe_relay_time_to_first_batch_seconds_bucket" in after_relay


def test_tracing_off_without_otel_variables() -> None:
    assert isinstance(setup_tracing("x", env={}), trace.NoOpTracerProvider)
    assert isinstance(setup_tracing("x", env={"OTEL_TRACES_EXPORTER": "none"}), trace.NoOpTracerProvider)
    with pytest.raises(ValueError, match="not supported"):
        setup_tracing("x", env={"OTEL_TRACES_EXPORTER": "zipkin-ish"})


class _Collector(BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP receiver: decodes ExportTraceServiceRequest protobufs."""

    received: ClassVar[list[tuple[str, str, str]]] = []  # (service, span name, trace id); reset per test

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.received.append((service, span.name, span.trace_id.hex()))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(240)
def test_up_exports_one_trace_over_otlp_http(tmp_path: Path, data_dir: Path) -> None:
    _Collector.received = []
    collector = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    port, nats_port = free_port(), free_port()
    (tmp_path / "models").symlink_to(data_dir / "models", target_is_directory=True)
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "TOKENPIPE_ANNOUNCE_INTERVAL_S": "0.5", "TOKENPIPE_METRICS_PORT": str(free_port())}
    proc = subprocess.Popen([sys.executable, "-m", "tokenpipe_cli", "up", "--model", "tiny-random", "--port", str(port),
                             "--nats-port", str(nats_port), "--data-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "tokenpipe is up" in line:
                break
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # shutdown flushes the exporters
    finally:
        if proc.poll() is None:
            proc.kill()
        collector.shutdown()
    traces: dict[str, set[str]] = {}
    for service, _, tid in _Collector.received:
        traces.setdefault(tid, set()).add(service)
    joint = [t for t, services in traces.items() if {"tokenpipe-relay", "tokenpipe-generator"} <= services]
    assert joint, json.dumps(_Collector.received)
    names = {name for _, name, tid in _Collector.received if tid == joint[0]}
    assert {"POST /v1/chat/completions", "publish tp.req.tiny-random.relay", "generate tiny-random", "prefill"} <= names
