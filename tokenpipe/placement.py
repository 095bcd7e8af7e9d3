"""Prefix-aware placement: a request goes to the generator whose prefix cache holds its prompt's start.

Every generator announces a :class:`~tokenpipe.wire.PlacementSummary` (hashed prompt prefixes it
served lately, its load, the placement slot it pulls first). Whoever submits a request (the relay,
the producer SDK) keeps the latest of each in a :class:`PlacementTable`, hashes the request the same
way (:func:`prefix_keys`) and, when one generator holds part of it, publishes it onto that
generator's slot subject (``tp.req.<model>.<owner>.p<k>``) instead of the shared queue. Through the
queue, never a direct call: the request is stored, redelivered and written once exactly as before
(tokenpipe.slots says how another generator takes it when its target cannot start it soon).

**Text-level keys.** A submitter has no tokenizer (the relay and the SDK never load the model), so the
keys are over the request's text, not its tokens: the canonical prompt text (each message's role and
content with separators; the prompt; the token ids written out) cut into full chunks of
:data:`CHUNK_CHARS` characters, each key a hash of its chunk and the key before it, so a key names the
whole text up to its chunk's end, as the engine's own block keys name a token prefix
(generator.engine.blocks). A chat turn resends the history, so its first chunks are the previous
turn's: the same keys. The generator hashes each request it starts the same way and records some of
its keys (every 4th and the last: enough to find the longest shared start, and a summary stays
small); they stand for what its prefix cache probably holds, evicted in the order it evicts (least
recently used, bounded). The chain starts from the owner, tenant and model: one owner's keys never
match another's requests, and a summary lets nobody test another tenant's text with their own keys
short of guessing that whole text.

**Choosing**, overlap against load: each generator scores the share of the request's chunks it holds
(its longest matching start; the request's ``session``, the OpenAI ``user``, found in its summary
counts as the whole, a hint for conversations whose start changed) less its load (running and waiting
over ``max_batch``, plus what this submitter placed there since its last summary, so that a burst is
spread before the summaries catch up). The best one gets it: a conversation stays where its history
is until that generator is loaded well beyond the others, and requests that match nowhere go to the
least loaded (32 unrelated streams over 2 generators ran 29 on one through the shared queue, whose
pulls race). Every generator with a full batch waiting: the shared queue, where each generator's
waiting room orders work by fair share.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .errors import TokenpipeError
from .subjects import PLACE_PREFIX
from .wire import PlacementSummary, Request

__all__ = ["CHUNK_CHARS", "MAX_KEYS", "Choice", "KeyRecord", "PlacementTable", "follow_summaries", "prefix_keys",
           "recorded_keys", "session_key"]

log = logging.getLogger(__name__)

CHUNK_CHARS = 256  # ~64 tokens of English: a few of the engine's 16-token blocks per key
MAX_KEYS = 2048  # per generator summary: ~36 KB of JSON at most
_KEY_BYTES = 8


def _root(owner: str, tenant: str, model: str) -> bytes:
    return hashlib.blake2b(f"{owner}\x00{tenant}\x00{model}".encode(), digest_size=_KEY_BYTES).digest()


def _canonical(request: Request) -> str:
    if request.messages is not None:
        return "".join(f"{m['role']}\x1f{m['content']}\x1e" for m in request.messages)
    if request.prompt is not None:
        return request.prompt
    return ",".join(map(str, request.input_ids or ()))


def prefix_keys(request: Request, owner: str) -> list[str]:
    """The chained keys of ``request``'s full text chunks (hex), first chunk first."""
    text, key, out = _canonical(request).encode(), _root(owner, request.tenant, request.model), []
    size = CHUNK_CHARS  # bytes of UTF-8: the same cut on both sides is all that matters
    for start in range(0, len(text) - size + 1, size):
        key = hashlib.blake2b(key + text[start:start + size], digest_size=_KEY_BYTES).digest()
        out.append(key.hex())
    return out


def session_key(request: Request, owner: str) -> str | None:
    """The key that stands for ``request``'s session hint, or None without one."""
    if not request.session:
        return None
    root = _root(owner, request.tenant, request.model)
    return "s" + hashlib.blake2b(root + request.session.encode(), digest_size=_KEY_BYTES).hexdigest()


def recorded_keys(keys: list[str]) -> list[str]:
    """The keys a generator records for a request it starts: every 4th and the last."""
    return [k for i, k in enumerate(keys) if i % 4 == 3 or i == len(keys) - 1]


class KeyRecord:
    """A generator's recorded keys, least recently used first, at most :data:`MAX_KEYS`."""

    def __init__(self, limit: int = MAX_KEYS) -> None:
        self.limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.version = 0  # moves on every change: the summary is sent again

    def add(self, keys: Iterable[str]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
            self.version += 1
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def keys(self) -> tuple[str, ...]:
        return tuple(self._keys)


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes: ``slot`` of ``worker``, for ``overlap`` matching chunks (0: by session)."""

    slot: int
    worker: str
    overlap: int
    reason: str  # "prefix", "session" or "load" (no match anywhere: the least loaded)


@dataclass(slots=True)
class _View:
    summary: PlacementSummary
    keys: frozenset[str]
    expires: float
    placed: int = 0  # placed there by this table since the summary

    @property
    def load(self) -> float:
        s = self.summary
        return (s.running + s.waiting + self.placed) / max(s.max_batch, 1)


class PlacementTable:
    """The latest summary of each generator, and the choice of one for a request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._views: dict[str, _View] = {}

    def update(self, summary: PlacementSummary) -> None:
        if not summary.ready:
            self._views.pop(summary.worker, None)
            return
        self._views[summary.worker] = _View(summary, frozenset(summary.keys), self._clock() + summary.ttl_s)

    def forget(self, worker: str) -> None:
        self._views.pop(worker, None)

    def live(self, model: str) -> list[PlacementSummary]:
        """The summaries of ``model``'s generators heard within their ttl."""
        now = self._clock()
        for worker in [w for w, v in self._views.items() if v.expires < now]:
            del self._views[worker]
        return [v.summary for v in self._views.values() if v.summary.model == model]

    def idle_elsewhere(self, model: str, worker: str) -> bool:
        """Whether another generator of ``model`` has a free slot and nothing waiting."""
        return self.free_elsewhere(model, worker) > 0

    def free_elsewhere(self, model: str, worker: str) -> int:
        """The free slots of ``model``'s other generators, all together."""
        return sum(max(0, s.max_batch - s.running - s.waiting) for s in self.live(model) if s.worker != worker)

    def choose(self, request: Request, owner: str) -> Choice | None:
        """The generator to place ``request`` (published by ``owner``) on, or None: the shared queue.
        A choice counts towards that generator's load until its next summary."""
        keys, session = prefix_keys(request, owner), session_key(request, owner)
        best: tuple[float, int, float] | None = None
        choice = None
        for s in self.live(request.model):
            view = self._views[s.worker]
            if s.slot < 0 or s.waiting >= max(s.max_batch, 1):
                continue  # no slot to place on; or a full batch waits there: any other is sooner
            overlap = next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in view.keys), 0)
            by_session = session is not None and session in view.keys
            held = 1.0 if by_session and not overlap else overlap / max(len(keys), 1)
            rank = (held - view.load, overlap, -view.load)
            if best is None or rank > best:
                reason = "prefix" if overlap else "session" if by_session else "load"
                best, choice = rank, Choice(s.slot, s.worker, overlap, reason)
        if choice is not None:
            self._views[choice.worker].placed += 1
        return choice


async def follow_summaries(nc: NATS, table: PlacementTable, model: str = "*") -> Subscription:
    """Keep ``table`` up to date from the summaries of ``model``'s generators (every model's by
    default); an undecodable one is dropped (logged), never raised into the connection's loop."""

    async def on_summary(msg: Msg) -> None:
        try:
            table.update(PlacementSummary.decode(msg.data))
        except TokenpipeError as exc:
            log.warning("placement summary dropped", extra={"subject": msg.subject, "error": exc.message})

    return await nc.subscribe(f"{PLACE_PREFIX}.{model}.*", cb=on_summary)
