"""Terminal views of the token streams, for debugging: ``tokenpipe replay`` (one kept stream, with
its original pacing), ``tokenpipe streams`` (the recent ones) and ``tokenpipe tail`` (the live ones)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from rich.console import Console
from rich.table import Table

from tokenpipe import streamrecord
from tokenpipe.bus import Bus
from tokenpipe.errors import TokenpipeError, WireFormatError
from tokenpipe.streamindex import stream_ids
from tokenpipe.streams import Gap, Ping, follow, get_meta, last_batch, paced
from tokenpipe.subjects import LIVE_WILDCARD
from tokenpipe.wire import StreamMeta, TokenBatch

__all__ = ["replay", "list_streams", "tail"]


async def replay(bus: Bus, stream_id: str, *, speed: float, as_json: bool, from_seq: int,
                 as_record: bool = False) -> int:
    """Print a stream's text (or one JSON object per batch) with its original pacing / ``speed``;
    ``as_record``: the whole stream as one :mod:`tokenpipe.streamrecord` document instead."""
    meta = await get_meta(bus, stream_id)  # a clear 'not found' instead of waiting on an unknown stream
    if as_record:
        print((await streamrecord.read(bus, meta)).model_dump_json(indent=1))
        return 0
    final: TokenBatch | None = None
    async for item in paced(follow(bus, stream_id, after_seq=from_seq - 1), speed):
        if isinstance(item, Ping):
            continue
        if isinstance(item, Gap):
            print(f"\n[batches {item.from_seq}..{item.to_seq} missing: {item.reason}]", file=sys.stderr)
            continue
        if as_json:
            print(json.dumps(item.to_json()), flush=True)
        else:
            print(item.text, end="", flush=True)
        final = item
    if not as_json:
        print()
    if final is not None and final.finish == "error":
        print(f"tokenpipe: stream ended in error: {final.error}", file=sys.stderr)
        return 1
    return 0


async def list_streams(bus: Bus, *, limit: int, console: Console) -> int:
    """Recent streams, newest first: id, model, tenant, tokens so far, finish, age."""
    metas: list[StreamMeta] = []
    for stream_id in await stream_ids(bus):
        try:
            entry = await bus.meta.get(stream_id)
        except KeyNotFoundError:  # deleted (its marker still names it) or aged out since
            continue
        if entry.value:
            metas.append(StreamMeta.decode(entry.value))
    metas.sort(key=lambda m: m.created_at, reverse=True)
    table = Table(title=f"recent streams ({min(limit, len(metas))} of {len(metas)})")
    for col in ("id", "model", "tenant", "tokens", "finish", "age"):
        table.add_column(col, justify="right" if col in ("tokens", "age") else "left")
    now = time.time_ns()
    for meta in metas[:limit]:
        last = await last_batch(bus, meta.id)
        tokens = str(last.index + len(last.token_ids)) if last else "0"
        finish = (last.finish or "running") if last else "queued/expired"
        table.add_row(meta.id, meta.model, meta.tenant, tokens, finish, _age((now - meta.created_at) / 1e9))
    console.print(table)
    return 0


async def tail(bus: Bus, *, model: str | None, console: Console) -> int:
    """Follow every live stream (or one model's): one line per batch until Ctrl-C."""
    models: dict[str, str] = {}

    async def on_batch(msg: Msg) -> None:
        try:
            batch = TokenBatch.decode(msg.data)
        except WireFormatError as exc:
            console.print(f"[red]undecodable batch on {msg.subject}: {exc.message}")
            return
        if model is not None:
            if batch.id not in models:
                try:
                    models[batch.id] = (await get_meta(bus, batch.id)).model
                except TokenpipeError:  # unknown owner: show nothing for a filtered tail
                    models[batch.id] = ""
            if models[batch.id] != model:
                return
        end = f" [bold]{batch.finish}[/]" if batch.finish else ""
        console.print(f"{batch.id} #{batch.seq} @{batch.index} +{len(batch.token_ids)}{end} {batch.text!r}",
                      highlight=False)

    sub = await bus.nc.subscribe(LIVE_WILDCARD, cb=on_batch)  # what the store accepted, as it does
    try:
        await asyncio.Event().wait()  # until Ctrl-C cancels us
    finally:
        await sub.unsubscribe()
    return 0


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
