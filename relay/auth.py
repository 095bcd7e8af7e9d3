"""API keys → tenants. Off when no key is configured (the relay then binds to loopback)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenpipe.errors import TokenpipeError

from .http import error_response

__all__ = ["KeyRing", "Unauthorized", "DEFAULT_TENANT", "AuthMiddleware", "TENANT_KEY", "authorization_header"]

TENANT_KEY = "tenant"  # in the ASGI scope's ``state``: ``request.state.tenant`` to the routes

DEFAULT_TENANT = "default"


class Unauthorized(TokenpipeError):
    status = 401
    code = "invalid_api_key"


@dataclass
class KeyRing:
    """Maps bearer keys to tenants, from ``TOKENPIPE_API_KEYS`` as ``key:tenant,key2:tenant2`` (a bare
    ``key`` is its own tenant, named by a hash of it) and/or a file with one ``key tenant`` (or
    ``key:tenant``) per line, ``#`` comments allowed."""

    keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, spec: str = "", path: str = "") -> KeyRing:
        entries = spec.split(",")
        if path:
            for line in Path(path).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                entries.append(line.replace(" ", ":", 1) if ":" not in line else line)
        keys: dict[str, str] = {}
        for entry in entries:  # a blank one has no key: skipped
            key, _, tenant = entry.partition(":")
            key, tenant = key.strip(), tenant.strip()
            if key:
                keys[key] = tenant or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant for an ``Authorization`` header; raises :class:`Unauthorized`."""
        if not self.enabled:
            return DEFAULT_TENANT
        if not authorization:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        for key, tenant in self.keys.items():
            if hmac.compare_digest(key.encode(), token.encode()):
                return tenant
        raise Unauthorized("invalid API key")


def authorization_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's one ``Authorization`` header (raw ASGI headers), or None. Two are refused:
    proxies and servers disagree on which one counts, so taking either silently is unsafe."""
    found = [value for name, value in headers if name == b"authorization"]
    if len(found) > 1:
        raise Unauthorized("more than one Authorization header: send exactly one")
    return found[0].decode("latin-1") if found else None


class AuthMiddleware:
    """Authentication before routing: every ``/v1/*`` path (and ``/metrics`` when ``metrics``)
    answers 401 without a valid key, whatever the method and whether the route exists, so an
    unauthenticated caller learns nothing about which routes or methods there are."""

    def __init__(self, app: ASGIApp, keys: KeyRing, *, metrics: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    def _guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (self.metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            try:
                tenant = self.keys.tenant_for(authorization_header(scope.get("headers", [])))
            except Unauthorized as exc:
                await error_response(exc)(scope, receive, send)
                return
            scope.setdefault("state", {})[TENANT_KEY] = tenant
        await self.app(scope, receive, send)
