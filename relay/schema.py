"""The relay's OpenAPI document, made truthful.

The routes parse their bodies themselves (:func:`relay.http.parse_json`: size limit, digit
limit, nesting, lone surrogates), so FastAPI cannot infer what they accept; the request
bodies, the errors every route can answer with (the OpenAI error body), the SSE responses and
the API-key scheme are described here, from the same limits the code enforces. The schema-driven
fuzz test (``tests/test_schema.py``) holds the code and this document to each other.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenpipe.params import MAX_STOP_LEN, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT
from tokenpipe.settings import Settings
from tokenpipe.wire import MAX_TOKEN_ID

from .native import MAX_SPEED, MIN_SPEED

__all__ = ["install_openapi", "ERROR_STATUSES"]

# Every status an API route may answer with besides its success, each with the OpenAI error body.
ERROR_STATUSES = {
    "400": "invalid request (bad JSON, bad field, lone surrogate, out-of-range number, bad query value)",
    "401": "missing or invalid API key",
    "404": "no such route, stream or model",
    "405": "method not allowed on this route",
    "413": "request body too large",
    "422": "request refused as unprocessable",
    "429": "too many unfinished streams for this key, or the model's queue is too deep",
    "503": "no generator serves the model, or NATS is unreachable",
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "enum": ["invalid_request_error", "authentication_error", "permission_error",
                                                "not_found_error", "rate_limit_error", "service_unavailable_error",
                                                "server_error"]},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
# Before OpenAPI 3.2 a ``text/event-stream`` schema describes one event (as schemathesis reads it).
_NATIVE_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"enum": ["tokens", "done", "error", "gap"]}, "data": {"type": "string"},
                   "id": {"type": "string", "pattern": "^[0-9]+$"}}}}}
_OPENAI_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"event": {"const": "message"}, "data": {"type": "string"}}}}}
_ID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_NULLABLE_BOOL = {"type": ["boolean", "null"]}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _sampling(settings: Settings, *, openai: bool) -> dict[str, Any]:
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}
    props: dict[str, Any] = {
        "max_tokens": _nullable({"type": "integer", "minimum": 1,
                                 "maximum": min(settings.max_tokens_cap, MAX_TOKENS_LIMIT)}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 1 << 20}),
        "seed": _nullable({"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1}),
        "ignore_eos": _NULLABLE_BOOL,
        "stop": _nullable({"anyOf": [stop_string,
                                     {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": stop_string}]}),
    }
    if openai:
        props["max_completion_tokens"] = props["max_tokens"]
    return props


def _messages(*, openai: bool) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "developer", "tool"]
    text = {"type": "string"}
    if openai:
        part = {"type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": text}}
        content: dict[str, Any] = {"anyOf": [text, {"type": "array", "items": part}]}
    else:
        content = text
    return {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": roles}, "content": content},  # other keys are ignored
    }}


def native_body(settings: Settings) -> dict[str, Any]:
    """``POST /v1/streams``: exactly one of ``prompt``, ``messages``, ``input_ids``; unknown fields are refused."""
    input_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                         "maximum": MAX_TOKEN_ID - 1}}
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "model": _nullable(_ID),
            "prompt": _nullable({"type": "string", "maxLength": settings.max_prompt_chars}),
            "messages": _nullable(_messages(openai=False)),
            "input_ids": _nullable(input_ids),
            "coalesce": _nullable({"type": "object", "properties": {
                "max_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": 4096}),
                "max_delay_ms": _nullable({"type": "number", "minimum": 0, "maximum": 10_000})}}),
            **_sampling(settings, openai=False),
        },
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
                  {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}}],
        "description": f"the prompt, or all messages' contents together, at most {settings.max_prompt_chars} "
                       "characters",
    }


def openai_body(settings: Settings, *, chat: bool) -> dict[str, Any]:
    """``/v1/chat/completions`` and ``/v1/completions``: OpenAI's fields; the unsupported ones
    are accepted only with their neutral value, unknown ones are ignored."""
    props: dict[str, Any] = {
        "model": _nullable({"type": "string"}),
        "stream": _NULLABLE_BOOL,
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "n": _nullable({"const": 1}),
        "user": _nullable({"type": "string"}),
        **_sampling(settings, openai=True),
    }
    if chat:
        props["messages"] = _messages(openai=True)
        required = ["messages"]
    else:
        props["prompt"] = {"anyOf": [
            {"type": "string", "maxLength": settings.max_prompt_chars},
            {"type": "array", "minItems": 1, "maxItems": 1,
             "items": {"type": "string", "maxLength": settings.max_prompt_chars}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                       "maximum": MAX_TOKEN_ID - 1}}]}
        required = ["prompt"]
    only_streaming = {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
                      "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
    return {"type": "object", "required": required, "properties": props, **only_streaming,
            "description": "`stream_options` only with `stream: true`; `model` names a served model (else 404)"}


# Path and query parameters whose bounds the route checks itself (FastAPI cannot say "0 or 0.01..1000").
_PARAMETERS: dict[str, dict[str, Any]] = {
    "stream_id": _ID,
    "speed": {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_SPEED, "maximum": MAX_SPEED}],
              "default": 1.0},
}

_SUCCESS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/streams/{stream_id}", "get"): {"200": {"description": "the stream as server-sent events",
                                                 "content": _NATIVE_SSE}},
    ("/v1/chat/completions", "post"): {"200": {"description": "a completion, or chunks as SSE with `stream: true`",
                                               "content": {"application/json": {"schema": {"type": "object"}},
                                                           **_OPENAI_SSE}}},
    ("/v1/completions", "post"): {"200": {"description": "a completion, or chunks as SSE with `stream: true`",
                                          "content": {"application/json": {"schema": {"type": "object"}},
                                                      **_OPENAI_SSE}}},
    ("/v1/streams", "post"): {"201": {"description": "the stream was created", "content": {"application/json": {
        "schema": {"type": "object", "required": ["id", "model", "stream_url"],
                   "properties": {"id": _ID, "model": {"type": "string"}, "stream_url": {"type": "string"}}}}}}},
    ("/metrics", "get"): {"200": {"description": "Prometheus metrics",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ("/", "get"): {"200": {"description": "the demo page", "content": {"text/html": {"schema": {"type": "string"}}}}},
}


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"] = _ERROR
    components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    bodies = {("/v1/streams", "post"): native_body(settings),
              ("/v1/chat/completions", "post"): openai_body(settings, chat=True),
              ("/v1/completions", "post"): openai_body(settings, chat=False)}
    paths = doc.get("paths", {})
    for path, item in paths.items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            if (path, method) in _SUCCESS:
                for code in [c for c in responses if c.startswith("2")]:
                    del responses[code]
                responses.update(copy.deepcopy(_SUCCESS[(path, method)]))
            if (path, method) in bodies:
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": bodies[(path, method)]}}}
            for param in op.get("parameters", []):
                if param.get("name") in _PARAMETERS:
                    param["schema"] = _PARAMETERS[param["name"]]
            guarded = path.startswith("/v1/") or (path == "/metrics" and settings.metrics_auth)
            if path == "/readyz":
                ready = responses.get("200", {}).get("content", {"application/json": {"schema": {}}})
                responses["503"] = {"description": "not ready (no NATS connection or no generator)",
                                    "content": ready}
                continue
            if not guarded:
                responses.pop("422", None)
                responses["405"] = {"description": ERROR_STATUSES["405"], "content": error_ref}
                continue
            op["security"] = [{"apiKey": []}]
            for code, why in ERROR_STATUSES.items():
                responses[code] = {"description": why, "content": error_ref}
    _link_created_stream(paths)
    return doc


def _link_created_stream(paths: dict[str, Any]) -> None:
    """OpenAPI links from a created stream to reading and deleting it (so a stateful client, and
    schemathesis, can follow the id the 201 returns)."""
    created = paths.get("/v1/streams", {}).get("post", {}).get("responses", {}).get("201")
    item = paths.get("/v1/streams/{stream_id}", {})
    if created is None:
        return
    links = {}
    for method, name in (("get", "ReadStream"), ("delete", "CancelStream")):
        operation_id = item.get(method, {}).get("operationId")
        if operation_id:
            links[name] = {"operationId": operation_id, "parameters": {"stream_id": "$response.body#/id"}}
    created["links"] = links


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve :func:`build_openapi`'s document at ``/openapi.json`` (built once, on first request)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cache:
            cache.update(build_openapi(app, settings))
        return cache

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the generator
