"""The rescoring service: `serve(settings)` runs it as processes: a supervisor, one engine (the model) and
front-ends (HTTP and per-request work). Importing this package loads no model and starts nothing."""

from .settings import Settings

__all__ = ["Settings", "serve"]


def __getattr__(name: str):
    if name == "serve":
        from .supervisor import serve

        return serve
    raise AttributeError(name)
