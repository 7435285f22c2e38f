"""The service's HTTP side, the only code of it that knows HTTP: the app (`create_app`), its
state and deadlines, middleware, error handlers, request bodies, responses, routes, and uvicorn
(`serve`). A request goes routes -> inputs -> batcher -> worker (its thread) -> routes."""

from .app import create_app
from .server import serve

__all__ = ["create_app", "serve"]
