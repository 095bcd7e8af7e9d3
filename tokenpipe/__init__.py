"""tokenpipe: a streaming token pipeline over NATS JetStream (shared core)."""

from .errors import (
    ConfigError,
    GenerationError,
    InvalidRequest,
    ModelNotFound,
    NoGenerator,
    Overloaded,
    StreamNotFound,
    TokenpipeError,
    TransportError,
    WireFormatError,
)
from .settings import Settings
from .wire import CoalesceParams, Request, SamplingParams, TokenBatch, Usage

__version__ = "0.1.0"

__all__ = [
    "Settings", "Request", "TokenBatch", "SamplingParams", "CoalesceParams", "Usage",
    "TokenpipeError", "InvalidRequest", "WireFormatError", "ModelNotFound", "NoGenerator",
    "StreamNotFound", "Overloaded", "TransportError", "GenerationError", "ConfigError", "__version__",
]
