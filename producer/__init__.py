"""tokenpipe producer SDK: submit jobs to the queue and stream their tokens over NATS."""

from .client import Producer, Result, StreamHandle
from .sync import SyncProducer

__all__ = ["Producer", "StreamHandle", "Result", "SyncProducer"]
