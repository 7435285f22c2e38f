"""A front-end's FastAPI app: its state, its lifespan (connected to the engine and its models loaded before the
app is ready), error handlers, middleware, routes and the OpenAPI document."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..board import Board
from ..schemas import RescoreRequest, ScoreRequest
from ..settings import Settings
from .errors import add_error_handlers
from .middleware import ApiKeyMiddleware, ArrivalMiddleware, BodyLimitMiddleware, MetricsMiddleware
from .routes import add_routes
from .state import Service

# The routes parse their own bodies (off the event loop when large), so FastAPI does not see these models:
# the OpenAPI document gets them here.
REQUEST_MODELS = {"/rescore": RescoreRequest, "/score": ScoreRequest}


def create_app(settings: Settings, rundir: str, index: int, board: Board) -> FastAPI:
    """Front-end `index` of the service whose run directory is `rundir` and whose board is `board`."""
    svc = Service(settings, rundir, index, board)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await svc.start()  # a model that fails to load sets svc.failed: never ready
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="smallstate-lm", version="0.1.0", lifespan=lifespan,
                  description="N-best and lattice rescoring with a small-state neural LM and a KenLM n-gram. "
                  "All scores are natural logarithms (higher is better).")
    app.state.service = svc
    add_error_handlers(app)
    # Added innermost first: metrics see everything, the key is checked before a body is read.
    app.add_middleware(BodyLimitMiddleware, svc=svc)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)
    app.add_middleware(ArrivalMiddleware, svc=svc)
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    add_routes(app, svc)
    app.openapi = functools.partial(_openapi, app)
    return app


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_MODELS.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema
