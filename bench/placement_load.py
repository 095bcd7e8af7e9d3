"""The placement benchmark's workload and the fleet's counters: multi-turn chats, each on its own
document, resent whole every turn as chat clients do; unrelated short streams; and each generator's
``/metrics`` read before and after, so that what the fleet did is told apart from what it did before.

Nothing here starts processes: :mod:`bench.placement` runs ``tokenpipe up`` and calls these.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from producer import aiter_sse

from .common import chat
from .rawhttp import raw_stream

__all__ = ["COUNTERS", "Counters", "Turn", "Unrelated", "chat_turn", "conversations", "delta", "document",
           "fleet_counters", "question", "turn_body", "unrelated", "wait_counted"]

# The generator's counters the benchmark reads (prometheus_client appends ``_total`` to a counter).
COUNTERS = {"hits": "tokenpipe_prefix_cache_hits_total", "queries": "tokenpipe_prefix_cache_queries_total",
            "requests": "tokenpipe_request_success_total", "prompt_tokens": "tokenpipe_prompt_tokens_total",
            "generation_tokens": "tokenpipe_generation_tokens_total"}

_WORDS = ("river", "stone", "market", "winter", "garden", "signal", "harbor", "copper", "lantern", "meadow",
          "engine", "valley", "letter", "bridge", "forest", "silver", "window", "orchard", "canal", "tower",
          "village", "thunder", "cotton", "mirror", "ladder", "candle", "island", "farmer", "painter", "doctor",
          "teacher", "sailor", "merchant", "baker", "soldier", "captain", "weaver", "miller", "hunter", "poet",
          "walked", "carried", "counted", "painted", "followed", "opened", "closed", "measured", "repaired",
          "remembered", "borrowed", "crossed", "guarded", "planted", "traded", "watched", "wrote", "sold",
          "quiet", "narrow", "ancient", "bright", "heavy", "golden", "patient", "distant", "careful", "early",
          "the", "a", "of", "and", "in", "near", "under", "after", "before", "with", "every", "each", "its")
_TOPICS = ("the harbor", "the tower", "the market", "the winter", "the bridge", "the orchard", "the captain",
           "the letters", "the canal", "the village")


Counters = list[dict[str, float]]
"""Each generator's :data:`COUNTERS`, in ``up.json``'s order of metrics ports."""


def document(conv: int, words: int) -> str:
    """Conversation ``conv``'s own document: ``words`` seeded words in sentences, under a title that
    differs from the first token on (no two conversations share a cached block beyond the template's)."""
    rng = random.Random(1000 + conv)
    out: list[str] = []
    while len(out) < words:
        n = rng.randint(8, 15)
        sentence = [rng.choice(_WORDS) for _ in range(n)]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out += sentence
    return f"Record {conv}: {rng.choice(_TOPICS)} ({rng.randrange(10**6)})\n\n" + " ".join(out[:words])


def question(conv: int, turn: int) -> str:
    """The ``turn``-th question of conversation ``conv``."""
    return f"Question {turn + 1}: what does the record say about {_TOPICS[(conv + 3 * turn) % len(_TOPICS)]}?"


@dataclass
class Turn:
    """One turn of one conversation, as its client saw it."""

    conv: int
    turn: int
    ttft_ms: float = float("nan")
    e2e_ms: float = float("nan")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None
    answer: str = ""

    @property
    def ok(self) -> bool:
        return self.finish in ("length", "stop")


async def chat_turn(http: httpx.AsyncClient, body: dict[str, Any], turn: Turn) -> None:
    """One streamed chat completion; TTFT is the first chunk with text (the relay's first chunk
    names the role only, before any token)."""
    start = time.perf_counter()
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            turn.finish, turn.error = "error", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for event in aiter_sse(resp):
            if event.data == "[DONE]":
                break
            chunk = event.json()
            if "error" in chunk:
                turn.finish, turn.error = "error", str(chunk["error"].get("message"))
                break
            if chunk.get("usage"):
                turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
                turn.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                text = choice.get("delta", {}).get("content")
                if text:
                    if not parts:
                        turn.ttft_ms = 1000 * (time.perf_counter() - start)
                    parts.append(text)
                if choice.get("finish_reason"):
                    turn.finish = choice["finish_reason"]
    turn.e2e_ms = 1000 * (time.perf_counter() - start)
    if turn.ttft_ms != turn.ttft_ms:  # nan: no text at all (an answer of empty tokens); its end stands in
        turn.ttft_ms = turn.e2e_ms
    turn.answer = "".join(parts)


async def conversations(url: str, *, count: int, turns: int, doc_words: int, answer_tokens: int,
                        concurrency: int, on_turn: Callable[[Turn], None], first: int = 0) -> list[Turn]:
    """``count`` conversations of ``turns`` turns each, run side by side (each one's turns in order,
    at most ``concurrency`` turns in flight; 0: no bound), every turn resending the whole history
    with the OpenAI ``user`` field naming the conversation (an affinity hint for placement).
    Conversations are numbered from ``first``: each number has its own document."""
    gate = asyncio.Semaphore(concurrency or count)
    done: list[Turn] = []

    async def one(conv: int, http: httpx.AsyncClient) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": document(conv, doc_words)}]
        for t in range(turns):
            messages.append({"role": "user", "content": question(conv, t)})
            body = turn_body(messages, answer_tokens, f"conv-{conv}")
            turn = Turn(conv, t)
            async with gate:
                await chat_turn(http, body, turn)
            done.append(turn)
            on_turn(turn)
            if not turn.ok:
                return  # the history is broken: its later turns would measure something else
            messages.append({"role": "assistant", "content": turn.answer})

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30)) as http:
        await asyncio.gather(*(one(c, http) for c in range(first, first + count)))
    return sorted(done, key=lambda t: (t.conv, t.turn))


def turn_body(messages: list[dict[str, str]], answer_tokens: int, user: str) -> dict[str, Any]:
    """A turn's streamed chat completion: the whole history, greedy, ``answer_tokens`` with ``ignore_eos``,
    the OpenAI ``user`` field naming the conversation (an affinity hint for placement)."""
    return {"messages": list(messages), "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": answer_tokens, "ignore_eos": True, "temperature": 0, "user": user}


@dataclass
class Unrelated:
    """The balance phase as the client saw it."""

    streams: int
    tokens: int = 0
    failed: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


async def unrelated(url: str, streams: int, max_tokens: int, on_done: Callable[[int], None]) -> Unrelated:
    """``streams`` distinct short chats at once over the native API, each read to its end."""
    out = Unrelated(streams)
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        rec = await raw_stream(url, {"messages": chat(2000 + i), "max_tokens": max_tokens, "ignore_eos": True,
                                     "temperature": 0})
        out.tokens += rec.tokens
        if not rec.ok:
            out.failed += 1
            out.errors.append(str(rec.error))
        finished += 1
        on_done(finished)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    out.wall_s = time.perf_counter() - start
    return out


async def fleet_counters(http: httpx.AsyncClient, ports: Sequence[int]) -> Counters:
    """Each generator's :data:`COUNTERS` now, summed over their labels (model, finish reason)."""
    out: Counters = []
    for port in ports:
        resp = await http.get(f"http://127.0.0.1:{port}/metrics")
        resp.raise_for_status()
        values = dict.fromkeys(COUNTERS, 0.0)
        names = {v: k for k, v in COUNTERS.items()}
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name in names:
                    values[names[sample.name]] += sample.value
        out.append(values)
    return out


def delta(after: Counters, before: Counters) -> Counters:
    """What each generator counted between two reads."""
    return [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]


async def wait_counted(http: httpx.AsyncClient, ports: Sequence[int], before: Counters, requests: int,
                       timeout: float = 60.0) -> Counters:
    """The fleet's counters once its generators have counted ``requests`` more finished requests than
    ``before`` (a client can see a stream's last batch before its generator counts it)."""
    deadline = time.monotonic() + timeout
    while True:
        now = await fleet_counters(http, ports)
        counted = sum(d["requests"] for d in delta(now, before))
        if counted >= requests or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.05)  # polling another process's counters until they say so
