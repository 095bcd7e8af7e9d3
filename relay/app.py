"""The relay: FastAPI app turning HTTP into NATS requests and token batches into SSE."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPBearer
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from tokenpipe.errors import ModelNotFound, TokenpipeError
from tokenpipe.metrics import render
from tokenpipe.params import invalid_request
from tokenpipe.settings import Settings

from . import batches, files, inspector, native, openai, ws
from .auth import TENANT_KEY, AuthMiddleware, authorization_header
from .batchrun import BatchRunner
from .http import RAW_SEND, error_body, error_response
from .observe import ObserveMiddleware
from .protocol import ERROR_STATUSES, Bodies, ErrorResponse, ModelCard, ModelList
from .state import RelayState

__all__ = ["create_app"]

# Declares the scheme in the OpenAPI document; AuthMiddleware checks the key before routing.
_BEARER = HTTPBearer(scheme_name="apiKey", auto_error=False)


async def authenticate(request: Request, _: Annotated[Any, Security(_BEARER)] = None) -> None:
    """The caller's tenant, as :class:`relay.auth.AuthMiddleware` resolved it before routing
    (resolved here when the app runs without it, as a bare ASGI app in a test might)."""
    if getattr(request.state, TENANT_KEY, None) is None:
        state: RelayState = request.app.state.relay
        request.state.tenant = state.keys.tenant_for(authorization_header(request.scope.get("headers", [])))


def _errors(statuses: dict[int, str], *, plain: bool = False) -> dict[int | str, dict[str, Any]]:
    """Error responses with the OpenAI error body. A route whose success is not JSON (``plain``)
    names the body's schema itself: FastAPI would file ``model`` under the route's media type."""
    if plain:
        schema = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}  # registered by the API routes
        return {code: {"description": why, "content": {"application/json": schema}} for code, why in statuses.items()}
    return {code: {"model": ErrorResponse, "description": why} for code, why in statuses.items()}


_NOT_ALLOWED = _errors({405: ERROR_STATUSES[405]}, plain=True)
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
    bodies = Bodies(settings)
    runner = BatchRunner(settings, state.batchdb, state.require_bus, state.registry, state.forwarder, bodies)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            await runner.start()
            yield
        finally:
            await runner.stop()  # its batches handed back before the connection closes
            await state.stop()

    app = _RelayApp(title="tokenpipe relay", version="0.1.0", lifespan=lifespan)
    app.state.relay = state
    app.state.inspector = inspector.Inspector(settings.token_max_age_s)

    @app.exception_handler(TokenpipeError)
    async def _tp_error(request: Request, exc: TokenpipeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(invalid_request(exc.errors(), skip=1))  # a 400 naming the field, not FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route matching the path only; a path served by
            # several routes (GET and DELETE /v1/streams/{id}) allows all of theirs.
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return JSONResponse(error_body(str(exc.detail), status=exc.status_code), status_code=exc.status_code,
                            headers=headers or None)

    @app.get("/healthz", responses=_NOT_ALLOWED)
    @app.get("/health", responses=_NOT_ALLOWED)  # the liveness path of vLLM, TGI and transformers serve
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    not_ready = {"description": "not ready (no NATS connection or no generator)",
                 "content": {"application/json": {"schema": {}}}}

    @app.get("/readyz", responses={**_NOT_ALLOWED, 503: not_ready})
    async def readyz() -> JSONResponse:
        body, status = await state.readiness()
        return JSONResponse(body, status_code=status)

    @app.get("/", response_class=HTMLResponse, responses=_NOT_ALLOWED)
    async def index() -> HTMLResponse:
        return HTMLResponse(resources.files("relay").joinpath("static/index.html").read_text(encoding="utf-8"))

    api = [Depends(authenticate)]
    guarded = _errors(ERROR_STATUSES)

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=api if settings.metrics_auth else [],
             responses=_errors(ERROR_STATUSES, plain=True) if settings.metrics_auth else _NOT_ALLOWED)
    async def metrics() -> Response:
        return Response(render(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=api, response_model=ModelList, responses=guarded)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=m) for m in state.registry.models()])

    @app.get("/v1/models/{model_id:path}", dependencies=api, response_model=ModelCard, responses=guarded)
    async def retrieve_model(model_id: str) -> ModelCard:
        """One model, as the OpenAI SDK's ``models.retrieve`` reads it; 404 when it is not served here."""
        if model_id not in state.registry.models():
            known = ", ".join(state.registry.models()) or "none yet"
            raise ModelNotFound(f"model {model_id!r} is not served here (available: {known})", param="model")
        return ModelCard(id=model_id)

    app.state.bodies = bodies
    app.state.batchrunner = runner
    app.include_router(native.router(bodies), dependencies=api, responses=guarded)
    app.include_router(inspector.router, dependencies=api, responses=guarded)
    app.include_router(inspector.page_router)
    app.include_router(openai.router(bodies), dependencies=api, responses=guarded)
    app.include_router(files.router, dependencies=api, responses=guarded)
    app.include_router(batches.router, dependencies=api, responses=guarded)
    app.include_router(ws.router)  # authenticates itself: a header, or a first auth frame (browsers)
    app.add_middleware(AuthMiddleware, keys=state.keys, metrics=settings.metrics_auth)
    app.add_middleware(ObserveMiddleware, tracer=state.tracer, metrics=state.metrics)
    return app
