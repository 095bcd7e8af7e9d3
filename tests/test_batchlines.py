"""A batch input line's checks (relay/batchlines.py), pure: what runs, and the error line each
bad one becomes (the stack-level tests are in tests/test_batchapi.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relay.batchlines import LineRejected, check_line
from relay.protocol import Bodies
from tokenpipe.settings import Settings

BODIES = Bodies(Settings.load(env={}))
CHAT = "/v1/chat/completions"


def line(**fields: Any) -> str:
    base = {"custom_id": "a", "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
    return json.dumps({**base, **fields})


def rejected(text: str, seen: set[str] | None = None, endpoint: str = CHAT) -> dict[str, Any]:
    with pytest.raises(LineRejected) as info:
        check_line(text, stream_id="batch_x-3", number=4, endpoint=endpoint, bodies=BODIES, seen=seen or set())
    kind, row = info.value.row
    assert kind == "err" and row["response"]["status_code"] == 400 and row["response"]["request_id"] == "batch_x-3"
    assert row["error"]["message"].startswith("request 4: ")
    return row


def test_a_good_line_runs_at_the_batch_class_whatever_tier_it_asked_for() -> None:
    seen: set[str] = set()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "service_tier": "priority"}
    custom_id, parsed = check_line(line(body=body), stream_id="s", number=1, endpoint=CHAT, bodies=BODIES, seen=seen)
    assert custom_id == "a" and seen == {"a"} and parsed.service_tier == "flex" and parsed.max_tokens == 4


@pytest.mark.parametrize(("fields", "code", "words"), [
    ({"custom_id": ""}, "missing_custom_id", "'custom_id' must be a non-empty string"),
    ({"method": "GET"}, "invalid_method", "'method' must be POST"),
    ({"url": "/v1/completions"}, "invalid_url", "this batch's endpoint is '/v1/chat/completions'"),
    ({"body": "hi"}, "invalid_body", "'body' must be a JSON object"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "stream": True}}, "invalid_body", "cannot stream"),
    ({"body": {"max_tokens": 4}}, "invalid_request", "messages"),
    ({"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}}, "invalid_request", "max_tokens"),
])
def test_a_bad_line_becomes_an_error_line_naming_what_is_wrong(fields: dict[str, Any], code: str, words: str) -> None:
    row = rejected(line(**fields))
    assert row["error"]["code"] == code and words in row["error"]["message"]


def test_a_line_that_is_no_json_object_or_repeats_a_custom_id_is_an_error_line() -> None:
    assert rejected("{oops")["error"]["code"] == "invalid_json"
    assert rejected("[1, 2]")["custom_id"] is None
    row = rejected(line(), seen={"a"})
    assert row["custom_id"] == "a" and row["error"]["code"] == "duplicate_custom_id"
