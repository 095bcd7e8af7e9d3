"""tokenpipe producer SDK: submit jobs to the queue and stream their tokens over NATS, or use the
relay's native HTTP/SSE or WebSocket API (:class:`RelayClient`, :class:`RelaySocket`, the SSE parser)."""

from .client import Producer, Result, StreamHandle
from .relay_client import RelayClient, aiter_sse
from .relay_socket import RelaySocket
from .sse import SSEEvent, SSEParser
from .sync import SyncProducer

__all__ = ["Producer", "StreamHandle", "Result", "SyncProducer", "RelayClient", "RelaySocket", "SSEEvent", "SSEParser",
           "aiter_sse"]
