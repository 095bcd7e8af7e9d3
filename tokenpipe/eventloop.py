"""Running a coroutine on the fastest event loop available."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (it is, via ``uvicorn[standard]``, except
    on Windows): a cheaper loop for per-message work such as the relay's and the workers'."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
