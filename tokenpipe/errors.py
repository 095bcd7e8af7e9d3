"""The one error hierarchy shared by every tokenpipe role.

Foreign exceptions (nats, msgpack, torch, pydantic) are translated into these at
the boundary with ``raise ... from exc`` so callers handle one family.
"""

from __future__ import annotations

__all__ = [
    "TokenpipeError",
    "InvalidRequest",
    "WireFormatError",
    "ModelNotFound",
    "NoGenerator",
    "StreamNotFound",
    "StreamExpired",
    "NotFound",
    "Overloaded",
    "RateLimited",
    "TransportError",
    "GenerationError",
    "ConfigError",
    "error_class",
]


class TokenpipeError(Exception):
    """Base class. ``code`` is a short machine-readable slug, ``status`` an HTTP status."""

    code = "internal_error"
    status = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(TokenpipeError):
    """The caller sent something malformed or out of range."""

    code = "invalid_request"
    status = 400


class WireFormatError(InvalidRequest):
    """Bytes on the wire could not be decoded into a tokenpipe message."""

    code = "invalid_wire_format"


class ModelNotFound(TokenpipeError):
    code = "model_not_found"
    status = 404


class StreamNotFound(TokenpipeError):
    code = "stream_not_found"
    status = 404


class StreamExpired(StreamNotFound):
    """The stream existed, but its token history is gone (retention, or removed) and nothing more
    will be stored: it is neither queued nor running."""

    code = "expired"


class NotFound(TokenpipeError):
    """A file or batch of the Batch API that does not exist, or belongs to another tenant."""

    code = "not_found"
    status = 404


class NoGenerator(TokenpipeError):
    code = "no_generator"
    status = 503


class Overloaded(TokenpipeError):
    """Too much work queued (or too many streams for one key); retry after ``retry_after`` s."""

    code = "overloaded"
    status = 429

    def __init__(self, message: str, *, retry_after: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class RateLimited(Overloaded):
    """An owner's quota (tokens per minute) is spent; retry after ``retry_after`` s. OpenAI's code."""

    code = "rate_limit_exceeded"


class TransportError(TokenpipeError):
    """NATS was unreachable or refused an operation."""

    code = "transport_error"
    status = 503


class GenerationError(TokenpipeError):
    """The engine failed while running a request."""

    code = "generation_error"
    status = 500


class ConfigError(TokenpipeError):
    """A setting, environment variable or command-line option is unusable (found at start-up)."""

    code = "config_error"
    status = 500


def error_class(code: str) -> type[TokenpipeError] | None:
    """The error class whose ``code`` is ``code`` (as an error body or batch carries it), if any."""
    pending: list[type[TokenpipeError]] = [TokenpipeError]
    while pending:
        cls = pending.pop()
        if cls.code == code:
            return cls
        pending.extend(cls.__subclasses__())
    return None
