"""Which generators are alive, from their announcements on NATS (no static list)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

__all__ = ["GeneratorRegistry", "GeneratorInfo"]

log = logging.getLogger(__name__)


@dataclass
class GeneratorInfo:
    worker: str
    model: str
    ready: bool
    expires: float
    max_batch: int = 0
    active: int = 0


class GeneratorRegistry:
    """Tracks announcements; an entry lapses after its ``ttl_s`` without a fresh one."""

    def __init__(self) -> None:
        self.workers: dict[str, GeneratorInfo] = {}
        self.seen_models: set[str] = set()
        self._lapsed: dict[str, float] = {}  # model -> when its last lapsed announcement expired

    def update(self, payload: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not payload:
            return  # a no-responders status on the discovery inbox: nobody to register
        try:
            obj = json.loads(payload)
            info = GeneratorInfo(
                worker=str(obj["worker"]),
                model=str(obj["model"]),
                ready=bool(obj.get("ready", True)),
                expires=now + float(obj.get("ttl_s", 6.0)),
                max_batch=int(obj.get("max_batch", 0)),
                active=int(obj.get("active", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring malformed generator announcement", extra={"error": str(exc)})
            return
        if info.ready:
            self.workers[info.worker] = info
            self.seen_models.add(info.model)
        else:
            self.workers.pop(info.worker, None)

    def live(self, now: float | None = None) -> list[GeneratorInfo]:
        now = time.monotonic() if now is None else now
        for key in [k for k, w in self.workers.items() if w.expires < now]:
            lapsed = self.workers.pop(key)
            self._lapsed[lapsed.model] = max(lapsed.expires, self._lapsed.get(lapsed.model, 0.0))
        return list(self.workers.values())

    def recently_lapsed(self, model: str, within: float, now: float | None = None) -> bool:
        """Whether a generator of ``model`` stopped announcing less than ``within`` seconds ago
        (it may be gone, or only late), rather than long ago or never."""
        now = time.monotonic() if now is None else now
        return now - self._lapsed.get(model, -float("inf")) < within

    def models(self) -> list[str]:
        return sorted({w.model for w in self.live()})

    def has_model(self, model: str) -> bool:
        return any(w.model == model for w in self.live())
