"""The rescoring service: `create_app(settings)` builds the FastAPI app, `serve(settings)` runs it
under uvicorn. Importing this package loads no model (that happens in the app's lifespan)."""

from .settings import Settings

__all__ = ["Settings", "create_app", "serve"]


def __getattr__(name: str):
    # FastAPI, uvicorn and torch are imported only when the app is wanted.
    if name in ("create_app", "serve"):
        from . import http

        return getattr(http, name)
    raise AttributeError(name)
