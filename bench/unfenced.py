"""The generator with the single-writer rule switched off: ``bench.fencecost``'s B side, nothing else.

    python -m bench.unfenced generator [tokenpipe generator options]

Runs ``tokenpipe`` with :class:`generator.publisher.BatchPublisher`'s append replaced by the
publisher before issue 23, reduced to its cost: every batch published at once with no
``Nats-Expected-Last-Subject-Sequence`` and no wait for its PubAck (acks are still collected, so
the server does the same storing work), its live copy sent straight after. The relay reads live
copies on ``tp.live`` now, so this side sends one core-NATS message per batch more than the old
publisher did (its live readers took the stored publish itself): the difference measured is, if
anything, a little smaller than the rule's whole cost. Never run this against streams that matter.
"""

from __future__ import annotations

import asyncio
import sys

from nats.js.api import PubAck

from generator.service.publisher import AppendChain, BatchPublisher, _Batch
from tokenpipe.append import send_live

__all__ = ["main"]


async def _append_unfenced(self: BatchPublisher, chain: AppendChain, item: _Batch) -> None:
    reply, fut = self._acks.expect()
    fut.add_done_callback(_observed)
    await self.bus.nc.publish(chain.subject, item.data, reply=reply, headers=item.headers)
    await send_live(self.bus, chain.owner, chain.stream_id, item.data, item.headers)
    if self.on_live is not None:  # the engine's wait for first batches (generator.runner.FirstBatchGate) alike
        self.on_live(chain.stream_id)


def _observed(fut: asyncio.Future[PubAck]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failed append costs this variant nothing; its exception is not left unretrieved


def main() -> int:
    from tokenpipe_cli.cli import main as tokenpipe

    BatchPublisher._append = _append_unfenced  # type: ignore[method-assign]
    return tokenpipe()


if __name__ == "__main__":
    sys.exit(main())
