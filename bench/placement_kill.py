"""Placement's kill -9 goal (issue 47): the generator holding a conversation is killed, and the
conversation's next turn, still placed on the dead generator's slot (its summary has not lapsed), is
taken by another generator.

One conversation runs two turns (the second finds the first's generator: the holder); the holder is
killed with SIGKILL and the third turn is sent at once (or ``delay_s`` later). At once is the worst case: a
request that reaches nats-server before it has seen the dead connection close is handed to the dead
generator's open pull and waits out ``ack_wait`` (2 s) before the survivor gets it; from ~50 ms after the
kill on, the survivor's own pull on that slot takes it at once. What it costs is that turn's TTFT against a
cold prefill of a history of the same shape (a new conversation's document, the same questions and
answers) once the fleet is whole again: the history's cache died with the holder, so a prefill is owed
either way, and what is left is the wait for someone to take the turn. The goal is the usual takeover
bound (:data:`TAKEOVER_BOUND_S`, a dead generator's streams moving on).

Nothing here starts processes: :mod:`bench.placement` runs ``tokenpipe up`` and calls :func:`kill_holder`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from tokenpipe_cli.upprocess import UpProcess

from .placement_load import Turn, chat_turn, delta, document, fleet_counters, question, turn_body, wait_counted

__all__ = ["TAKEOVER_BOUND_S", "Kill", "kill_holder"]

TAKEOVER_BOUND_S = 3.0
"""A dead generator's work moves on within this (issue 48's takeover goal): the bound the next turn is held to."""


@dataclass
class Kill:
    """One kill -9 of a conversation's generator, as the conversation's client saw it."""

    conv: int
    holder: int  # the generator killed (its index in up.json)
    delay_s: float  # between the kill and the next turn
    warm_ms: float  # the turn before the kill, on the holder, its history cached
    after_kill_ms: float  # the next turn, sent right after the kill
    cold_ms: float  # a history of the same shape, never seen, once the fleet was whole again
    prompt_tokens: int
    cold_prompt_tokens: int
    served_by: list[int]  # the generators whose request counters the next turn moved

    @property
    def extra_ms(self) -> float:
        """What the kill cost the turn beyond the prefill it owed anyway."""
        return self.after_kill_ms - self.cold_ms

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "extra_ms": self.extra_ms}


async def _turn(http: httpx.AsyncClient, conv: int, number: int, messages: list[dict[str, str]],
                answer_tokens: int, user: str) -> Turn:
    turn = Turn(conv, number)
    await chat_turn(http, turn_body(messages, answer_tokens, user), turn)
    if not turn.ok:
        raise RuntimeError(f"conversation {conv} turn {number + 1} failed: {turn.error}")
    return turn


async def _served(http: httpx.AsyncClient, ports: Sequence[int], conv: int, number: int, messages: list[dict[str, str]],
                  answer_tokens: int, user: str) -> tuple[Turn, list[int]]:
    """One turn, and the generators (indexes into ``ports``) that counted it."""
    before = await fleet_counters(http, ports)
    turn = await _turn(http, conv, number, messages, answer_tokens, user)
    after = await wait_counted(http, ports, before, 1)
    return turn, [i for i, d in enumerate(delta(after, before)) if d["requests"] > 0]


async def _restarted(up: UpProcess, name: str, killed: int, timeout: float = 300) -> None:
    """Until ``tokenpipe up`` has ``name`` running again as a new process, and every role ready."""
    deadline = time.monotonic() + timeout
    while up.role(name).get("pid") in (None, killed):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not restarted within {timeout:g} s")
        await asyncio.sleep(0.1)  # up.json, written by another process: polled
    await up.wait_up(timeout)


async def kill_holder(up: UpProcess, ports: Sequence[int], *, conv: int, doc_words: int, answer_tokens: int,
                      delay_s: float = 0.0) -> Kill:
    """Conversation ``conv``'s two turns, kill -9 of the generator that served them, the next turn
    ``delay_s`` later; then, the fleet whole again, a cold history of that turn's shape."""
    async with httpx.AsyncClient(base_url=up.url, timeout=httpx.Timeout(300, connect=30)) as http:
        return await _kill_holder(up, http, ports, conv=conv, doc_words=doc_words, answer_tokens=answer_tokens,
                                  delay_s=delay_s)


async def _kill_holder(up: UpProcess, http: httpx.AsyncClient, ports: Sequence[int], *, conv: int, doc_words: int,
                       answer_tokens: int, delay_s: float) -> Kill:
    user = f"conv-{conv}"
    messages = [{"role": "system", "content": document(conv, doc_words)}]
    answers: list[str] = []
    served: list[int] = []
    turn = Turn(conv, 0)
    for number in range(2):
        messages.append({"role": "user", "content": question(conv, number)})
        turn, served = await _served(http, ports, conv, number, messages, answer_tokens, user)
        messages.append({"role": "assistant", "content": turn.answer})
        answers.append(turn.answer)
    if len(served) != 1:
        raise RuntimeError(f"conversation {conv}'s second turn was counted by generators {served}, not one")
    holder, warm_ms = served[0], turn.ttft_ms
    killed = int(up.role(f"generator-{holder}")["pid"])
    os.kill(killed, signal.SIGKILL)
    if delay_s > 0:
        await asyncio.sleep(delay_s)  # the client's think time: what the bench varies
    messages.append({"role": "user", "content": question(conv, 2)})
    survivors = [p for i, p in enumerate(ports) if i != holder]
    before = await fleet_counters(http, survivors)
    after_kill = await _turn(http, conv, 2, messages, answer_tokens, user)
    moved = delta(await wait_counted(http, survivors, before, 1), before)
    by = [i + (i >= holder) for i, d in enumerate(moved) if d["requests"] > 0]  # back to up.json's indexes
    await _restarted(up, f"generator-{holder}", killed)  # the cold turn meets the fleet the next turn would have met
    # The same shape never seen: another document (its own first token on), the same questions and answers.
    cold_messages = [{"role": "system", "content": document(conv + 1, doc_words)}]
    for number, answer in enumerate(answers):
        cold_messages += [{"role": "user", "content": question(conv, number)}, {"role": "assistant", "content": answer}]
    cold_messages.append({"role": "user", "content": question(conv, 2)})
    cold = await _turn(http, conv + 1, 2, cold_messages, answer_tokens, f"conv-{conv + 1}")
    return Kill(conv=conv, holder=holder, delay_s=delay_s, warm_ms=warm_ms, after_kill_ms=after_kill.ttft_ms,
                cold_ms=cold.ttft_ms, prompt_tokens=after_kill.prompt_tokens, cold_prompt_tokens=cold.prompt_tokens,
                served_by=by)
