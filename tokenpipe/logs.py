"""Structured logging: ``key=value`` (or JSON) lines carrying request ids."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}


class _Formatter(logging.Formatter):
    def __init__(self, role: str, as_json: bool) -> None:
        super().__init__()
        self.role = role
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in _RESERVED}
        if self.as_json:
            out = {
                "ts": round(record.created, 6),
                "level": record.levelname.lower(),
                "role": self.role,
                "logger": record.name,
                "msg": record.getMessage(),
                **extra,
            }
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out, default=str)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        tail = " ".join(f"{k}={v}" for k, v in extra.items())
        line = f"{ts} {record.levelname:<5} {self.role:<9} {record.getMessage()}" + (f" {tail}" if tail else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(role: str, level: str = "INFO", as_json: bool = False) -> None:
    """Configure the root logger for one process. Call once from the CLI, never at import."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(role, as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "uvicorn.access", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
