"""The OpenAI Batch API (issue 46, parts 4 and 5) against `tokenpipe up` (tiny-random, NATS with
authorization on, so the relay's permissions are the ones the table documents): the official
``openai`` SDK unmodified, tenant isolation, bad input, cancel, and a batch that survives a kill -9
of the relay."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tokenpipe_cli.upprocess import UpProcess

from .conftest import wait_until
from .test_heal import TOKENPIPE, running_stack

pytestmark = pytest.mark.timeout(600)

KEYS = "key-a:alice,key-b:bob"
MAX_FILE = 64 << 10


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    async with running_stack(tmp_path_factory, data_dir, "batchapi", 1, TOKENPIPE_API_KEYS=KEYS,
                             TOKENPIPE_BATCH_FILE_MAX_BYTES=str(MAX_FILE), TOKENPIPE_BATCH_CONCURRENCY="4") as s:
        yield s


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def client(stack: UpProcess, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)


async def finished(sdk: openai.AsyncOpenAI, batch_id: str, timeout: float = 180) -> Any:
    state: dict[str, Any] = {}

    async def done() -> bool:
        state["b"] = await sdk.batches.retrieve(batch_id)
        return state["b"].status in ("completed", "failed", "cancelled")

    await wait_until(done, timeout, f"batch {batch_id} to finish")
    return state["b"]


async def test_the_openai_sdk_runs_a_batch_unmodified_and_a_bad_line_goes_to_the_error_file(
        stack: UpProcess) -> None:
    sdk = client(stack)
    good = [chat_line(f"q{i}", f"Tell me about the number {i}") for i in range(3)]
    bad_body = {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                "body": {"max_tokens": 4}}  # no messages
    bad_url = {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    f = await sdk.files.create(file=("in.jsonl", jsonl([good[0], bad_body, good[1], bad_url, good[2]])),
                               purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = await finished(sdk, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    error_lines = (await sdk.files.content(done.error_file_id)).text.splitlines()
    errors = {e["custom_id"]: e for e in map(json.loads, error_lines)}
    assert [o["custom_id"] for o in out] == ["q0", "q1", "q2"]
    assert set(errors) == {"bad-body", "bad-url"}
    assert "messages" in errors["bad-body"]["error"]["message"]
    assert "/v1/embeddings" in errors["bad-url"]["error"]["message"]
    # Each answer is the one the interactive route gives for the same greedy request (same tokens).
    async with httpx.AsyncClient(base_url=stack.url, headers={"Authorization": "Bearer key-a"}, timeout=60) as http:
        for line, row in zip(good, out, strict=True):
            assert row["response"]["status_code"] == 200 and row["error"] is None
            body = row["response"]["body"]
            assert body["service_tier"] == "flex"
            direct = (await http.post("/v1/chat/completions", json=line["body"])).json()
            assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            assert body["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
            # The line ran as a stream of its own, readable through the native API.
            assert (await http.get(f"/v1/streams/{row['response']['request_id']}",
                                   params={"cancel_on_disconnect": "false"})).status_code == 200
        # The inspector lists the batch's streams: the three lines that ran, not the two refused.
        page = (await http.get("/v1/streams", params={"batch": done.id, "limit": 100})).json()
        assert sorted(item["id"] for item in page["data"]) == sorted(row["response"]["request_id"] for row in out)
        assert {item["status"] for item in page["data"]} == {"finished"}
    listed = await sdk.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]


async def test_a_tenant_sees_and_cancels_only_its_own_files_and_batches(stack: UpProcess) -> None:
    alice, bob = client(stack, "key-a"), client(stack, "key-b")
    f = await alice.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi", 64)])), purpose="batch")
    batch = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id),
                 lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert batch.id not in [b.id for b in (await bob.batches.list()).data]
    assert f.id not in [x.id for x in (await bob.files.list()).data]
    assert (await finished(alice, batch.id)).status == "completed"


async def test_bad_input_is_refused_with_the_openai_error_status(stack: UpProcess) -> None:
    sdk = client(stack)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await sdk.files.create(file=("x.jsonl", jsonl([chat_line("a", "hi")])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="line 2 is not JSON"):
        await sdk.files.create(file=("x.jsonl", jsonl([chat_line("a", "hi"), "{not json"])), purpose="batch")
    with pytest.raises(openai.APIStatusError) as too_large:
        await sdk.files.create(file=("x.jsonl", b"{}\n" * (MAX_FILE // 3 + 1)), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.NotFoundError, match="file-000000000000000000000000"):
        await sdk.batches.create(input_file_id="file-000000000000000000000000", endpoint="/v1/chat/completions",
                                 completion_window="24h")
    f = await sdk.files.create(file=("x.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        await sdk.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                                 completion_window="24h")


async def test_a_cancelled_batch_stops_its_lines_in_flight_and_keeps_what_was_done(stack: UpProcess) -> None:
    sdk = client(stack)
    lines = [chat_line(f"c{i}", f"story {i}", 1024) for i in range(80)]
    f = await sdk.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def running() -> bool:
        b = await sdk.batches.retrieve(batch.id)
        return b.status == "in_progress" and b.request_counts is not None and b.request_counts.completed >= 1

    await wait_until(running, 120, "the batch running, a line done")
    assert (await sdk.batches.cancel(batch.id)).status == "cancelling"
    done = await finished(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and counts.completed >= 1 and counts.completed + counts.failed < 80
    out = (await sdk.files.content(done.output_file_id)).text.splitlines()
    assert len(out) == counts.completed  # the lines done are kept; the others were never written


async def test_a_batch_survives_a_kill9_of_the_relay(stack: UpProcess) -> None:
    sdk = client(stack)
    lines = [chat_line(f"r{i}", f"line {i}", 48) for i in range(24)]
    f = await sdk.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def some_done() -> bool:
        b = await sdk.batches.retrieve(batch.id)
        return b.request_counts is not None and b.request_counts.completed >= 2

    await wait_until(some_done, 120, "a few lines done")
    before = (await sdk.batches.retrieve(batch.id)).request_counts
    relay_pid = stack.role("relay")["pid"]
    os.kill(relay_pid, signal.SIGKILL)
    await wait_until(lambda: stack.role("relay").get("pid") != relay_pid
                     and stack.role("relay").get("state") == "ready", 120, "the relay back")
    # request_counts keep moving from where they were: the runner that took the batch over reads
    # the finished lines back from the store, and its own counts (from 0) never replace larger ones.
    seen = [before]

    async def watched() -> bool:
        b = await sdk.batches.retrieve(batch.id)
        seen.append(b.request_counts)
        return b.status in ("completed", "failed", "cancelled")

    await wait_until(watched, 240, f"batch {batch.id} to finish")
    completed = [c.completed for c in seen if c is not None]
    assert completed == sorted(completed), completed
    done = await finished(sdk, batch.id, timeout=240)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (24, 0)
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
    # The relay that took over read the lines already submitted back from their streams: each line
    # was generated exactly once.
    finishes = re.findall(rf"request finished request_id=({batch.id}-\d+)", stack.output())
    assert sorted(finishes) == sorted(f"{batch.id}-{i}" for i in range(24))


async def test_tokenpipe_submit_batch_runs_a_file_and_writes_its_output(stack: UpProcess, tmp_path: Path) -> None:
    src = tmp_path / "jobs.jsonl"
    src.write_bytes(jsonl([chat_line("one", "hello"), chat_line("two", "world"),
                           {"custom_id": "three", "method": "POST", "url": "/v1/chat/completions", "body": []}]))
    proc = await asyncio.create_subprocess_exec(
        TOKENPIPE, "submit", "--batch", str(src), "--url", stack.url, "--api-key", "key-a",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 1, err.decode()  # one line failed
    assert "completed: 2/3 done, 1 failed" in err.decode()
    out = [json.loads(x) for x in (tmp_path / "jobs.output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["one", "two"]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in out)
    (error,) = [json.loads(x) for x in (tmp_path / "jobs.output.errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "three" and "'body' must be a JSON object" in error["error"]["message"]


async def test_a_batch_survives_a_kill9_of_the_generator(stack: UpProcess) -> None:
    sdk = client(stack)
    lines = [chat_line(f"g{i}", f"generator {i}", 64, ignore_eos=True) for i in range(16)]
    f = await sdk.files.create(file=("g.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def some_done() -> bool:
        b = await sdk.batches.retrieve(batch.id)
        return b.request_counts is not None and b.request_counts.completed >= 1

    await wait_until(some_done, 120, "a line done")
    generator = next(r for r in stack.status()["roles"] if r["name"].startswith("generator"))
    os.kill(generator["pid"], signal.SIGKILL)
    done = await finished(sdk, batch.id, timeout=300)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (16, 0)
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
    # A line continued on the restarted generator has the tokens of an uninterrupted run.
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    async with httpx.AsyncClient(base_url=stack.url, headers={"Authorization": "Bearer key-a"}, timeout=60) as http:
        for line in lines:
            direct = (await http.post("/v1/chat/completions", json=line["body"])).json()
            got = by_id[line["custom_id"]]
            assert got["usage"]["completion_tokens"] == 64
            assert got["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


async def test_batches_are_listed_newest_first_in_pages(stack: UpProcess) -> None:
    sdk = client(stack, "key-b")  # bob's own batches only
    f = await sdk.files.create(file=("p.jsonl", jsonl([chat_line("p", "page", 2)])), purpose="batch")
    made = [(await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")).id for _ in range(3)]
    everything = (await sdk.batches.list(limit=100)).data
    assert set(made) <= {b.id for b in everything}
    assert [b.created_at for b in everything] == sorted((b.created_at for b in everything), reverse=True)
    first = await sdk.batches.list(limit=2)
    assert first.has_more and len(first.data) == 2 and first.last_id == first.data[-1].id
    rest = await sdk.batches.list(limit=100, after=first.last_id)
    assert [b.id for b in first.data] + [b.id for b in rest.data] == [b.id for b in everything]
    assert not rest.has_more
    for batch_id in made:
        assert (await finished(sdk, batch_id)).status == "completed"


WINDOW_S = 4  # the short window's stack: a batch longer than this expires


@pytest.fixture(scope="module")
async def short_window(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    async with running_stack(tmp_path_factory, data_dir, "batchexpiry", 1, TOKENPIPE_API_KEYS=KEYS,
                             TOKENPIPE_BATCH_WINDOW_S=str(WINDOW_S), TOKENPIPE_BATCH_CONCURRENCY="2") as s:
        yield s


async def test_a_batch_past_its_completion_window_expires_and_every_line_is_accounted_for(
        short_window: UpProcess) -> None:
    """expires_at is enforced (it was only shown): past it the lines in flight are cancelled, the ones
    not done go to the error file as OpenAI's ``batch_expired``, the ones done stay in the output."""
    sdk = client(short_window)
    # Far more work than the window holds at two lines at a time: most lines cannot be done in time.
    lines = [chat_line(f"e{i}", f"expiring {i}", 1024, ignore_eos=True) for i in range(40)]
    f = await sdk.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == WINDOW_S

    async def ended() -> bool:
        b = await sdk.batches.retrieve(batch.id)
        return b.status not in ("validating", "in_progress", "finalizing")

    await wait_until(ended, 120, "the batch to end")
    done = await sdk.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at is not None and done.expired_at >= batch.expires_at
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed + counts.failed) == (40, 40)
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()] \
        if done.output_file_id else []
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).text.splitlines()]
    assert sorted(r["custom_id"] for r in out + errors) == sorted(x["custom_id"] for x in lines)
    assert len(out) == counts.completed and len(errors) == counts.failed >= 30
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 1024 for o in out)
    # The lines cancelled in flight stopped: no generator is left running them.
    async with httpx.AsyncClient(base_url=short_window.url, headers={"Authorization": "Bearer key-a"},
                                 timeout=30) as http:
        async def none_running() -> bool:
            page = (await http.get("/v1/streams", params={"batch": batch.id, "limit": 100})).json()
            return all(item["status"] != "running" for item in page["data"])

        await wait_until(none_running, 60, "the expired batch's streams to stop")


@pytest.fixture(scope="module")
async def one_delivery(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    """Two generators, each request delivered once at most: a line held by a generator that dies ends in
    `generation_error` at once (its one delivery spent), as one did after a kill -9 of a generator and of a
    NATS node had used up its three."""
    async with running_stack(tmp_path_factory, data_dir, "batchretry", 2, TOKENPIPE_API_KEYS=KEYS,
                             TOKENPIPE_MAX_DELIVER="1", TOKENPIPE_BATCH_CONCURRENCY="8") as s:
        yield s


async def test_a_line_whose_generator_died_with_it_runs_again_and_the_batch_loses_nothing(
        one_delivery: UpProcess) -> None:
    """Regression (issue 46): a 500-line batch across a kill -9 of a generator and of a NATS node put one
    good line in the error file, its stream ended by the server ("attempted 3 times and every worker
    stopped"). A line whose stream ends in such a server-side failure runs again, as `<id>-r1`."""
    stack = one_delivery
    sdk = client(stack)
    n = 16
    f = await sdk.files.create(file=("r.jsonl", jsonl([chat_line(f"r{i}", f"retry line {i}", 512, ignore_eos=True)
                                                        for i in range(n)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    gen0 = stack.role("generator-0")["pid"]

    def holds_lines() -> bool:
        held = stack.announcements.get(gen0)
        return held is not None and any(s.startswith(batch.id) for s in held.streams)

    await wait_until(holds_lines, 120, "generator-0 running lines of the batch")
    os.kill(gen0, signal.SIGKILL)
    done = await finished(sdk, batch.id, timeout=300)
    assert done.status == "completed", done
    counts = done.request_counts
    errors = [] if done.error_file_id is None else \
        [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).text.splitlines()]
    assert counts is not None and (counts.completed, counts.failed) == (n, 0), (counts, errors[:3])
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(n))
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 512 for o in out)
    rerun = [o["response"]["request_id"] for o in out if o["response"]["request_id"].endswith("-r1")]
    assert rerun, "no line was held by the killed generator (nothing to retry)"
