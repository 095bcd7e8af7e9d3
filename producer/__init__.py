"""tokenpipe producer SDK: submit jobs to the queue and stream their tokens over NATS, or use the
relay's native HTTP/SSE API (:class:`RelayClient`, and the SSE parser under it)."""

from .client import Producer, Result, StreamHandle
from .relay_client import RelayClient, aiter_sse
from .sse import SSEEvent, SSEParser
from .sync import SyncProducer

__all__ = ["Producer", "StreamHandle", "Result", "SyncProducer", "RelayClient", "SSEEvent", "SSEParser", "aiter_sse"]
