"""The generator's status listener: /healthz from the start, /readyz only while it serves, /metrics."""

from __future__ import annotations

import httpx

from generator.service.health import StatusServer
from generator.service.worker import GeneratorWorker


async def test_readyz_follows_the_worker_and_healthz_holds_from_the_start(generator: GeneratorWorker) -> None:
    status = StatusServer("127.0.0.1", 0).start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{status.port}", timeout=10) as http:
            assert (await http.get("/healthz")).status_code == 200  # the model may still be loading
            assert (await http.get("/readyz")).status_code == 503
            assert (await http.get("/metrics")).status_code == 503
            status.registry, status.worker = generator.metrics.registry, generator
            assert (await http.get("/readyz")).status_code == 200
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and "tokenpipe" in metrics.text
            assert (await http.get("/nope")).status_code == 404
    finally:
        status.stop()


async def test_healthz_fails_when_the_event_loop_stalls(generator: GeneratorWorker) -> None:
    status = StatusServer("127.0.0.1", 0, stall_s=0.0).start()
    try:
        status._beat -= 5  # as if the loop had not turned for 5 s
        assert status.answer("/healthz")[0] == 503
    finally:
        status.stop()
