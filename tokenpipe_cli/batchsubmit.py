"""``tokenpipe submit --batch FILE``: a JSONL file of requests through the relay's Batch API
(upload, create the batch, show its progress, write its output and error files)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .uprole import read_status

__all__ = ["relay_url", "run_batch"]

_POLL_S = 0.5  # how often the batch's progress is asked for
_FINAL = ("completed", "failed", "cancelled", "expired")


def relay_url(given: str | None, data_dir: str) -> str:
    """``--url``, else the relay of the ``tokenpipe up`` in ``data_dir``, else the default port."""
    if given:
        return given.rstrip("/")
    return str(read_status(Path(data_dir)).get("relay_url") or "http://127.0.0.1:8000")


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:500]
        raise SystemExit(f"tokenpipe: {resp.request.method} {resp.request.url.path}: {resp.status_code} {message}")
    body: dict[str, Any] = resp.json()
    return body


def run_batch(path: Path, *, url: str, api_key: str, endpoint: str, output: Path | None,
              timeout_s: float = 24 * 3600) -> int:
    """Run the batch in ``path`` to the end; the output lines go to ``output`` (default
    ``<file>.output.jsonl``) and the failed ones to ``<output stem>.errors.jsonl``. 0 when every line
    succeeded, 1 when some failed, 2 when the batch itself failed or was cancelled."""
    out = output or path.with_suffix(".output.jsonl")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        uploaded = _check(http.post("/v1/files", data={"purpose": "batch"},
                                    files={"file": (path.name, path.read_bytes(), "application/jsonl")}))
        batch = _check(http.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                      "completion_window": "24h"}))
        print(f"tokenpipe: batch {batch['id']} created from {path} ({uploaded['bytes']} bytes)", file=sys.stderr)
        shown = ""
        deadline = time.monotonic() + timeout_s
        while batch["status"] not in _FINAL:
            if time.monotonic() > deadline:
                print(f"tokenpipe: batch {batch['id']} still {batch['status']}; stopped waiting", file=sys.stderr)
                return 2
            time.sleep(_POLL_S)  # polling the relay: the Batch API has no push
            batch = _check(http.get(f"/v1/batches/{batch['id']}"))
            counts = batch.get("request_counts") or {}
            line = (f"{batch['status']}: {counts.get('completed', 0)}/{counts.get('total', 0)} done, "
                    f"{counts.get('failed', 0)} failed")
            if line != shown:
                print(f"\rtokenpipe: {line}", end="", file=sys.stderr, flush=True)
                shown = line
        print(file=sys.stderr)
        for key, dest in (("output_file_id", out), ("error_file_id", out.with_name(out.stem + ".errors.jsonl"))):
            if batch.get(key):
                resp = http.get(f"/v1/files/{batch[key]}/content")
                if resp.status_code >= 400:
                    _check(resp)
                dest.write_bytes(resp.content)
                print(f"tokenpipe: wrote {dest}", file=sys.stderr)
    if batch["status"] != "completed":
        errors = (batch.get("errors") or {}).get("data") or []
        print(f"tokenpipe: batch {batch['status']}" + "".join(f": {e['message']}" for e in errors), file=sys.stderr)
        return 2
    return 1 if (batch.get("request_counts") or {}).get("failed") else 0
