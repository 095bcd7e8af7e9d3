"""Background loops, and how they end: by a flag they check, not by a cancel alone.

A cancelled task can swallow its cancellation: on Python 3.11 ``asyncio.wait_for`` returns the
result instead of raising when the awaited future completed in the same loop iteration as the
cancel (CPython gh-86296, fixed in 3.12), and nats-py awaits every request that way (its
``_flush_pending`` also drops a ``CancelledError``). A loop cancelled while a NATS request's reply
is landing then carries on with its next round, and whoever awaits it waits for ever: a
generator's ``stop()`` hung so (the announcer's and the repair loop's requests), in most runs of
the short-of-KV-blocks worker test. So every loop here waits between rounds with :func:`pause`,
which ends at once when ``stopping`` is set, and :func:`stop_loops` sets it before it cancels: a
cancel only cuts short the round in flight; a swallowed one ends the loop at its next pause.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["pause", "stop_loops"]


async def pause(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less when ``stopping`` is set; whether to go on (not stopping)."""
    if stopping.is_set():
        return False
    try:
        async with asyncio.timeout(seconds):
            await stopping.wait()
    except TimeoutError:
        return True
    return False


async def stop_loops(stopping: asyncio.Event, tasks: Iterable[asyncio.Task[None]]) -> None:
    """Set ``stopping``, cancel ``tasks`` (to cut short what each awaits now), and wait until
    they ended: one whose cancel was swallowed ends at its next :func:`pause`."""
    stopping.set()
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
