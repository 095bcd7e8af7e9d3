"""Owners, their weights and their token quota: the policy fair share and quotas apply per owner.

An owner is who a request is served for: the tenant for a request the relay published (the relay
set it from the caller's API key), else the application that published it on the bus (its subject
``tp.req.<model>.<app>``; the payload's ``tenant`` is the app's to choose, so it is not trusted to
split one app into many owners). Fair share (:mod:`generator.engine.scheduler`) divides a
generator's slots between owners in proportion to their weights (``TOKENPIPE_OWNER_WEIGHTS``);
:class:`TokenRate` refuses an owner's request past its tokens per minute
(``TOKENPIPE_OWNER_TOKENS_PER_MIN``) with the seconds after which it would fit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping

from .errors import ConfigError, RateLimited
from .subjects import RELAY_OWNER

__all__ = ["TokenRate", "fair_owner", "parse_weights", "request_cost", "weight_of"]

_WINDOW_S = 60.0
# Characters per token when a prompt is charged before it is tokenized (the relay has no tokenizer):
# OpenAI's rate limiter estimates the same way, and English text runs ~4 characters a token.
_CHARS_PER_TOKEN = 4


def fair_owner(bus_owner: str, tenant: str) -> str:
    """Who a request is served for: ``tenant`` for the relay's requests, else the app that published it."""
    return tenant if bus_owner == RELAY_OWNER and tenant else bus_owner


def parse_weights(spec: str) -> dict[str, float]:
    """``TOKENPIPE_OWNER_WEIGHTS`` (``alice=2,bob=1``) as a mapping; an owner not named weighs 1."""
    weights: dict[str, float] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, sep, raw = entry.partition("=")
        try:
            weight = float(raw) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not name.strip() or not weight > 0 or math.isinf(weight):
            raise ConfigError(f"TOKENPIPE_OWNER_WEIGHTS: {entry!r} is not `owner=weight` with a weight above 0",
                              param="owner_weights")
        weights[name.strip()] = weight
    return weights


def request_cost(max_tokens: int, prompt_chars: int) -> int:
    """Tokens a request is charged against its owner's quota when it is accepted: the completion it
    may produce (``max_tokens``) and its prompt, estimated from its characters."""
    return max(max_tokens, 0) + -(-max(prompt_chars, 0) // _CHARS_PER_TOKEN)


class TokenRate:
    """Tokens per minute per owner over a sliding 60 s window, in this process (each relay replica
    and each generator counts what it accepted: N of them let an owner through up to N times the
    quota). ``per_minute`` <= 0: no quota."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._spent: dict[str, deque[tuple[float, int]]] = {}
        self._totals: dict[str, int] = {}

    def charge(self, owner: str, cost: int) -> None:
        """Charge ``cost`` tokens to ``owner``, or raise :class:`RateLimited` naming the quota and
        the seconds after which this request would fit. A request costing more than the whole quota
        is let through once the owner has spent nothing in the window (else it could never run)."""
        if self.per_minute <= 0:
            return
        now = self.clock()
        spent = self._spent.setdefault(owner, deque())
        total = self._expire(owner, spent, now)
        if total and total + cost > self.per_minute:
            # The earliest moment enough of the window has expired for this request to fit.
            need, freed, wait = total + cost - self.per_minute, 0, _WINDOW_S
            for at, tokens in spent:
                freed += tokens
                if freed >= need:
                    wait = at + _WINDOW_S - now
                    break
            retry = max(1, math.ceil(wait))
            raise RateLimited(f"tokens-per-minute quota of {owner!r} reached ({total} of {self.per_minute} "
                              f"tokens in the last minute, this request counts {cost}: max_tokens and its prompt); "
                              f"retry after {retry} s (TOKENPIPE_OWNER_TOKENS_PER_MIN)", retry_after=retry)
        spent.append((now, cost))
        self._totals[owner] = total + cost

    def spent(self, owner: str) -> int:
        """Tokens charged to ``owner`` within the last minute."""
        spent = self._spent.get(owner)
        if spent is None:
            return 0
        total = self._expire(owner, spent, self.clock())
        if not spent:  # an owner that went quiet is forgotten
            del self._spent[owner], self._totals[owner]
        return total

    def _expire(self, owner: str, spent: deque[tuple[float, int]], now: float) -> int:
        """Drop what left the window; the owner's total within it."""
        total = self._totals.get(owner, 0)
        while spent and spent[0][0] <= now - _WINDOW_S:
            total -= spent.popleft()[1]
        if not spent:
            total = 0
        self._totals[owner] = total
        return total


def weight_of(weights: Mapping[str, float], owner: str) -> float:
    """``owner``'s weight (1 when not named)."""
    return weights.get(owner, 1.0)
