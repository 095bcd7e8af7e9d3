"""The relay: FastAPI app turning HTTP into NATS requests and token batches into SSE."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from tokenpipe.errors import TokenpipeError
from tokenpipe.metrics import render
from tokenpipe.settings import Settings

from . import inspector, native, openai
from .auth import TENANT_KEY, AuthMiddleware
from .http import RAW_SEND, error_body, error_response
from .observe import ObserveMiddleware
from .schema import install_openapi
from .state import RelayState

__all__ = ["create_app"]


async def authenticate(request: Request) -> None:
    """The caller's tenant, as :class:`relay.auth.AuthMiddleware` resolved it before routing
    (resolved here when the app runs without it, as a bare ASGI app in a test might)."""
    if getattr(request.state, TENANT_KEY, None) is None:
        state: RelayState = request.app.state.relay
        request.state.tenant = state.keys.tenant_for(request.headers.get("authorization"))


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route fully matches for this path (asked per method: included routers
    are wrapped, so their routes cannot simply be listed)."""
    return [method for method in _METHODS
            if any(route.matches({**scope, "method": method})[0] == Match.FULL for route in app.router.routes)]


class _RelayApp(FastAPI):
    """Hands the server's own ``send`` to SSE responses (see :class:`relay.http.SSEResponse`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, tracer_provider: TracerProvider | None = None) -> FastAPI:
    """The relay's ASGI app; NATS is connected in its lifespan."""
    state = RelayState(settings, tracer_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = _RelayApp(title="tokenpipe relay", version="0.1.0", lifespan=lifespan)
    app.state.relay = state
    app.state.inspector = inspector.Inspector(settings.token_max_age_s)

    @app.exception_handler(TokenpipeError)
    async def _tp_error(request: Request, exc: TokenpipeError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ())]
        message = f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, status=400, code="invalid_request", param=loc[-1] if loc else None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route matching the path only; a path served by
            # several routes (GET and DELETE /v1/streams/{id}) allows all of theirs.
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return JSONResponse(error_body(str(exc.detail), status=exc.status_code), status_code=exc.status_code,
                            headers=headers or None)

    @app.get("/healthz")
    @app.get("/health")  # the liveness path of vLLM, TGI and transformers serve; guidellm checks it
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        body, status = await state.readiness()
        return JSONResponse(body, status_code=status)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        page = resources.files("relay").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    api = [Depends(authenticate)]

    @app.get("/v1/models", dependencies=api)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "tokenpipe", "created": 0}
                                           for m in state.registry.models()]}

    app.include_router(native.router, dependencies=api)
    app.include_router(inspector.router, dependencies=api)
    app.include_router(inspector.page_router)
    app.include_router(openai.router, dependencies=api)
    install_openapi(app, settings)
    app.add_middleware(AuthMiddleware, keys=state.keys, metrics=settings.metrics_auth)
    app.add_middleware(ObserveMiddleware, tracer=state.tracer, metrics=state.metrics)
    return app
