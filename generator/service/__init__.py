"""The service layer: the generator on NATS. Pulling requests, the worker's lifecycle and cancels,
each stream's coalesced and conditional appends, announcements, the status listener and metrics.
It drives the engine only through :class:`generator.engine.EngineHandle`."""

from .coalesce import Coalescer
from .health import StatusServer
from .worker import GeneratorWorker

__all__ = ["Coalescer", "GeneratorWorker", "StatusServer"]
