"""`serve`: the HTTP service (service/), its settings from options, environment and `--set`."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import ConfigError


def serve(
    # readable=False: an unreadable file is refused below in one line, not by click's three-line usage error
    lm: Optional[Path] = typer.Option(None, "--lm", readable=False,
                                      help="Neural LM run directory or checkpoint (env SMALLSTATE_LM)."),
    ngram: Optional[Path] = typer.Option(None, "--ngram", readable=False,
                                         help="KenLM ARPA/binary (env SMALLSTATE_NGRAM)."),
    weights: Optional[Path] = typer.Option(None, "--weights", readable=False,
                                           help="Default weights.json (env SMALLSTATE_WEIGHTS)."),
    host: Optional[str] = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (default 8000)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda, cuda:N (default auto)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for PyTorch (default: all cores)."),
    batching: Optional[bool] = typer.Option(None, "--batching/--no-batching", help="Dynamic batching (default on)."),
    set_: List[str] = typer.Option([], "--set", help="Any other setting key=value, e.g. --set max_wait_ms=10 "
                                   "(see docs/service.md; env SMALLSTATE_<KEY> works too)."),
):
    """Serve rescoring over HTTP (FastAPI + uvicorn): POST /rescore, /score; GET /healthz, /readyz, /metrics."""
    from ..service import Settings
    from ..service import serve as run_server

    options = {"lm": str(lm) if lm else None, "ngram": str(ngram) if ngram else None,
               "weights": str(weights) if weights else None, "host": host, "port": port, "device": device,
               "threads": threads, "batching": batching}
    settings = Settings.from_env(assignments=set_, **options)
    _check_readable(settings)
    _check_port(settings.host, settings.port)
    if settings.lm is not None:
        from ..checkpoint import load_model

        # The app loads the model in its lifespan, where a bad file becomes a uvicorn traceback: load and
        # self-check it here first (on the CPU, then dropped) so that it is one line and exit status 2.
        load_model(settings.lm)
    run_server(settings)


def _check_readable(settings) -> None:
    """The files the settings name, readable by this process (a container's user may not be their owner)."""
    for key in ("lm", "ngram", "weights"):
        path = getattr(settings, key)
        if path is None or os.path.isdir(path):
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"--{key} {path}: cannot be read ({e.strerror or e})") from None


def _check_port(host: str, port: int) -> None:
    """The port free before the model loads (a minute on a large model), not found taken after it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--port {port} on {host}: cannot listen there ({e.strerror or e})") from None
