"""Which generators are alive, from their announcements on NATS (no static list), and which
model a request gets."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenpipe.errors import ModelNotFound, NoGenerator, WireFormatError
from tokenpipe.subjects import check_model_name
from tokenpipe.wire import Announcement

__all__ = ["GeneratorRegistry", "GeneratorInfo"]

log = logging.getLogger(__name__)

# How long a request waits for a generator whose announcements just lapsed: late (a stalled event
# loop), or reconnecting after its NATS node hung, which takes the stale-connection check (6-8 s).
_LAPSED_GRACE_S = 10.0
_LAPSED_RECENT_S = 30.0  # ... when they lapsed at most this long ago (long gone: 503 at once)


@dataclass
class GeneratorInfo:
    worker: str
    model: str
    expires: float
    max_batch: int = 0  # its slots: requests it holds beyond them wait in its waiting room


async def _nobody_to_ask() -> None:
    return None


class GeneratorRegistry:
    """Tracks announcements; an entry lapses after its ``ttl_s`` without a fresh one. ``default_model``
    is the model of a request that names none (when it is served, or nothing is); ``wait_s`` how long
    :meth:`resolve` waits for a model to be announced; ``discover`` asks every generator to announce itself."""

    def __init__(self, *, default_model: str = "", wait_s: float = 0.0,
                 discover: Callable[[], Awaitable[None]] = _nobody_to_ask) -> None:
        self.default_model = default_model
        self.wait_s = wait_s
        self.discover = discover
        self.workers: dict[str, GeneratorInfo] = {}
        self.seen_models: set[str] = set()
        self._lapsed: dict[str, float] = {}  # model -> when its last lapsed announcement expired

    def update(self, payload: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not payload:
            return  # a no-responders status on the discovery inbox: nobody to register
        try:
            ann = Announcement.decode(payload)
        except WireFormatError as exc:
            log.warning("ignoring malformed generator announcement", extra={"error": exc.message})
            return
        if ann.ready:
            self.workers[ann.worker] = GeneratorInfo(worker=ann.worker, model=ann.model, expires=now + ann.ttl_s,
                                                     max_batch=ann.max_batch)
            self.seen_models.add(ann.model)
        else:
            self.workers.pop(ann.worker, None)

    def slots(self, model: str) -> int:
        """The slots of ``model``'s live generators together (what they can run at once)."""
        return sum(w.max_batch for w in self.live() if w.model == model)

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

    async def resolve(self, model: str | None) -> str:
        """The model to use; 404 if nobody ever served it, 503 if its generators are gone."""
        if model is None:
            models = self.models()
            model = self.default_model if self.default_model in models or not models else models[0]
        check_model_name(model)
        wait_s = self.wait_s
        if not self.has_model(model) and self.recently_lapsed(model, _LAPSED_RECENT_S):
            # Announcements just lapsed: the generator may be gone, or only late (a stalled event
            # loop, a slow network). Ask it directly and give it a moment before answering 503.
            await self.discover()
            wait_s = max(wait_s, _LAPSED_GRACE_S)
        deadline = time.monotonic() + wait_s
        while not self.has_model(model):
            if time.monotonic() >= deadline:
                if model in self.seen_models:
                    raise NoGenerator(f"no generator is currently serving model {model!r}")
                known = ", ".join(self.models()) or "none yet"
                raise ModelNotFound(f"model {model!r} is not served here (available: {known})", param="model")
            await asyncio.sleep(0.1)  # waiting for an announcement; bounded by wait_s
        return model
