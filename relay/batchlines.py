"""One line of a batch input file, checked, and the output and error lines of the Batch API
(OpenAI's format: ``{id, custom_id, response: {status_code, request_id, body}, error}``). Pure:
:mod:`relay.batchrun` runs what passes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenpipe.errors import InvalidRequest

from .protocol import Bodies, ChatCompletionRequest, CompletionRequest, parse

__all__ = ["LineRejected", "Row", "check_line", "error_row", "expired_row", "output_row"]

Row = tuple[str, dict[str, Any]]  # ("out", output line) or ("err", error line)


@dataclass
class LineRejected(Exception):
    """A line that cannot run, as the error line it becomes."""

    row: Row


def error_row(stream_id: str, custom_id: str | None, status: int, code: str, message: str,
              param: str | None = None) -> Row:
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": code}}
    return "err", {"id": f"batch_req_{stream_id}", "custom_id": custom_id,
                   "response": {"status_code": status, "request_id": stream_id, "body": body},
                   "error": {"code": code, "message": message}}


def expired_row(stream_id: str, custom_id: str | None) -> Row:
    """A line its batch's completion window ended before it was done (OpenAI's ``batch_expired``)."""
    return "err", {"id": f"batch_req_{stream_id}", "custom_id": custom_id, "response": None,
                   "error": {"code": "batch_expired",
                             "message": "This request could not be executed before the completion window expired."}}


def output_row(stream_id: str, custom_id: str, status: int, reply: dict[str, Any]) -> Row:
    """A finished line: the output file's when it succeeded, the error file's otherwise."""
    return ("out" if status == 200 else "err"), {
        "id": f"batch_req_{stream_id}", "custom_id": custom_id,
        "response": {"status_code": status, "request_id": stream_id, "body": reply}, "error": None}


def check_line(line: str, *, stream_id: str, number: int, endpoint: str, bodies: Bodies,
               seen: set[str]) -> tuple[str, ChatCompletionRequest | CompletionRequest]:
    """``(custom_id, body)`` of request ``number`` (1-based) run as ``stream_id``, its body parsed as
    the endpoint's route parses it, at the batch class; :class:`LineRejected` when it cannot run.
    ``seen``: the custom ids before it (this one is added)."""
    custom_id: str | None = None

    def reject(code: str, message: str, param: str | None = None) -> LineRejected:
        return LineRejected(error_row(stream_id, custom_id, 400, code, f"request {number}: {message}", param))

    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise reject("invalid_json", f"not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise reject("invalid_json", "not a JSON object")
    given = raw.get("custom_id")
    if not isinstance(given, str) or not given:
        raise reject("missing_custom_id", "'custom_id' must be a non-empty string", "custom_id")
    custom_id = given
    if custom_id in seen:
        raise reject("duplicate_custom_id", f"'custom_id' {custom_id!r} is used twice", "custom_id")
    seen.add(custom_id)
    if raw.get("method", "POST") != "POST":
        raise reject("invalid_method", "'method' must be POST", "method")
    if raw.get("url") != endpoint:
        raise reject("invalid_url", f"'url' is {raw.get('url')!r}, but this batch's endpoint is {endpoint!r}", "url")
    body = raw.get("body")
    if not isinstance(body, dict):
        raise reject("invalid_body", "'body' must be a JSON object", "body")
    if body.get("stream"):
        raise reject("invalid_body", "a batch line cannot stream ('stream': true)", "body.stream")
    model = bodies.chat if endpoint == "/v1/chat/completions" else bodies.completion
    try:
        return custom_id, parse(model, {**body, "service_tier": "flex"})
    except InvalidRequest as exc:
        raise LineRejected(error_row(stream_id, custom_id, 400, exc.code, f"request {number}: {exc.message}",
                                     exc.param)) from exc
