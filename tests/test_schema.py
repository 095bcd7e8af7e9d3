"""Schema-driven fuzzing: schemathesis against the real relay, every route, every check.

The relay runs in this process (real uvicorn, real nats-server, the tiny generator, API keys
on); schemathesis runs as its CLI in a subprocess against ``/openapi.json`` with deterministic
generation (the same cases every run, so a failure reproduces; a seed is not used in that
mode). Generation is capped small (``max_tokens_cap``) so the run stays bounded; admission limits are raised so that the
thousand-odd streams the run creates are not refused for load (a 429 is documented, but the
run should exercise the routes, not the limiter).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from generator.service.worker import GeneratorWorker
from tokenpipe.settings import Settings

from .conftest import start_relay

KEY = "key-schema"
MAX_EXAMPLES = 100  # per operation and phase; with coverage and stateful ~1,900 cases in all
CHECKS = "all"  # not_a_server_error, status/content-type/headers/schema conformance, positive/negative data, auth...


CONFIG = Path(__file__).with_name("schemathesis.toml")


def schemathesis_command(url: str, report: Path) -> list[str]:
    """The CLI run (printed by the test, to rerun by hand against a running relay)."""
    st = str(Path(sys.executable).with_name("st"))
    return [st, "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", CHECKS,
            "--exclude-checks", "use_after_free",  # DELETE cancels; the history stays readable (schemathesis.toml)
            "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic",
            "--phases", "examples,coverage,fuzzing,stateful",
            "--header", f"Authorization: Bearer {KEY}", "--workers", "1", "--request-timeout", "30", "--no-color",
            "--suppress-health-check", "all", "--report", "ndjson", "--report-ndjson-path", str(report)]


def summarise(report: Path) -> tuple[int, Counter[int], Counter[str], list[tuple[str, str]]]:
    """Cases generated, statuses seen, checks passed and checks failed, from the run's ndjson events."""
    cases = 0
    statuses: Counter[int] = Counter()
    passed: Counter[str] = Counter()
    failed: list[tuple[str, str]] = []
    for line in report.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if finished is None:
            continue
        recorder: dict[str, Any] = finished.get("recorder") or {}
        cases += len(recorder.get("cases") or {})
        for interaction in (recorder.get("interactions") or {}).values():
            if interaction.get("response") is not None:
                statuses[int(interaction["response"]["status_code"])] += 1
        for case_checks in (recorder.get("checks") or {}).values():
            for check in case_checks:
                if check["status"] == "success":
                    passed[check["name"]] += 1
                elif check["status"] != "skip":
                    failed.append((recorder.get("label", "?"), check["name"]))
    return cases, statuses, passed, failed


async def test_schemathesis_every_route_no_server_error_schema_holds(settings: Settings, generator: GeneratorWorker,
                                                                    tmp_path: Path) -> None:
    relay = await start_relay(settings.replace(api_keys=f"{KEY}:schema", max_tokens_cap=2, max_prompt_chars=400,
                                               max_streams_per_key=1 << 20, max_queue_depth=1 << 20,
                                               keepalive_s=5.0),
                              ready_headers={"Authorization": f"Bearer {KEY}"})
    report = tmp_path / "events.ndjson"
    cmd = schemathesis_command(relay.url, report)
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, cwd=tmp_path)
        out, _ = await proc.communicate()
        text = out.decode(errors="replace")
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:  # and the relay still serves
            r = await http.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                json={"prompt": "still there?", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        await relay.stop()
    cases, statuses, passed, failed = summarise(report)
    print(" ".join(cmd))
    print(f"schemathesis: {cases} cases generated, statuses {dict(sorted(statuses.items()))}, "
          f"checks passed {dict(passed)}")
    assert proc.returncode == 0, text[-6000:]
    assert not failed, failed
    assert cases >= 1000, text[-3000:]
    assert not [s for s in statuses if s >= 500], statuses
    for check in ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                  "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
                  "positive_data_acceptance", "ignored_auth", "unsupported_method"):
        assert passed[check] > 0, check  # each check really ran
