"""A batch across faults on a cluster (issue 46): `tokenpipe up --nats-cluster 3 --generators 2`,
a batch of ~100 lines (tiny-random) with a few malformed ones, and while it runs a kill -9 of a
generator and then of a NATS node. It completes with every line in the output or the error file,
each answer the tokens of an uninterrupted run. Its issue's own size, 500 lines of SmolLM2, is the same
test with ``TOKENPIPE_BATCHFAULTS_LINES=500 TOKENPIPE_BATCHFAULTS_MODEL=smollm2-135m`` (a few minutes on
2 cores; the suite runs the small form)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tokenpipe_cli.upprocess import UpProcess

from .conftest import wait_until
from .test_batchapi import chat_line, client, finished, jsonl
from .test_heal import running_stack

pytestmark = pytest.mark.timeout(600)

LINES = int(os.environ.get("TOKENPIPE_BATCHFAULTS_LINES", "96"))
MODEL = os.environ.get("TOKENPIPE_BATCHFAULTS_MODEL", "tiny-random")
TOKENS = 32


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    model = ("--model", MODEL, "--dtype", "auto") if MODEL != "tiny-random" else ()
    async with running_stack(tmp_path_factory, data_dir, "batchfaults", 2, "--nats-cluster", "3", *model,
                             TOKENPIPE_API_KEYS="key-a:alice", TOKENPIPE_BATCH_CONCURRENCY="16") as s:
        yield s


async def test_a_batch_completes_across_a_kill9_of_a_generator_and_of_a_nats_node(cluster: UpProcess) -> None:
    sdk = client(cluster)
    lines: list[object] = [chat_line(f"l{i}", f"line {i} of the night's batch", TOKENS, ignore_eos=True)
                           for i in range(LINES)]
    malformed = {7: {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
                 40: {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
                 80: {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}}}
    for at, bad in sorted(malformed.items()):
        lines.insert(at, bad)
    f = await sdk.files.create(file=("night.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def completed_at_least(n: int) -> bool:
        b = await sdk.batches.retrieve(batch.id)
        return b.request_counts is not None and b.request_counts.completed >= n

    await wait_until(lambda: completed_at_least(8), 180, "the batch running")
    generator = next(r for r in cluster.status()["roles"] if r["name"] == "generator-0")
    os.kill(generator["pid"], signal.SIGKILL)
    progress = (await sdk.batches.retrieve(batch.id)).request_counts
    assert progress is not None
    await wait_until(lambda: completed_at_least(progress.completed + 8), 180, "the batch going on after the kill")
    node = cluster.role("nats-server-1")
    os.kill(node["pid"], signal.SIGKILL)

    done = await finished(sdk, batch.id, timeout=420)
    assert done.status == "completed", done
    counts = done.request_counts
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).text.splitlines()]
    lost = [e for e in errors if str(e["custom_id"]) not in ("None", "no-body", "wrong-url")]
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (LINES + 3, LINES, 3), \
        (counts, lost[:5])
    assert sorted(o["custom_id"] for o in out) == sorted(f"l{i}" for i in range(LINES))
    assert sorted(str(e["custom_id"]) for e in errors) == ["None", "no-body", "wrong-url"]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == TOKENS for o in out)
    # Both faults were real: the roles came back as new processes.
    assert cluster.role("generator-0")["pid"] != generator["pid"]
    assert cluster.role("nats-server-1")["pid"] != node["pid"]
    if MODEL != "tiny-random":
        # A quantized model's kernel depends on how many rows a step runs (the kernel table), so a line
        # batched with others is not bit-identical to the same line alone; the unquantized fp32 form is.
        return
    # Greedy lines, wherever they ran and however often they moved: the tokens of an uninterrupted run.
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    async with httpx.AsyncClient(base_url=cluster.url, headers={"Authorization": "Bearer key-a"}, timeout=60) as http:
        for i in range(0, LINES, 8):
            line = chat_line(f"l{i}", f"line {i} of the night's batch", TOKENS, ignore_eos=True)
            direct = (await http.post("/v1/chat/completions", json=line["body"])).json()
            assert by_id[f"l{i}"]["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
