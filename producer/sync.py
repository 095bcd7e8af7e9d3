"""A small blocking wrapper over :class:`Producer` for scripts and notebooks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from .client import Producer, Result

__all__ = ["SyncProducer"]


class SyncProducer:
    """Runs a private event loop on a thread; every method blocks until done."""

    def __init__(self, nats_url: str, *, tenant: str = "default") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenpipe-producer", daemon=True)
        self._thread.start()
        self._producer: Producer = self._call(Producer.connect(nats_url, tenant=tenant))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, model: str, **kw: Any) -> Result:
        """Submit and wait for the whole result."""
        handle = self._call(self._producer.submit(model, **kw))
        return self._call(handle.result())  # type: ignore[no-any-return]

    def stream(self, model: str, **kw: Any) -> Iterator[str]:
        """Submit and yield text deltas as they arrive."""
        handle = self._call(self._producer.submit(model, **kw))
        agen = handle.text().__aiter__()
        while True:
            try:
                yield self._call(agen.__anext__())
            except StopAsyncIteration:
                return

    def cancel(self, stream_id: str) -> None:
        self._call(self._producer.cancel(stream_id))

    def close(self) -> None:
        self._call(self._producer.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
