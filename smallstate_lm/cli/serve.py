"""`serve`: the HTTP service (service/), its settings from options, environment and `--set`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


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
    precision: Optional[str] = typer.Option(None, "--precision", help="Neural LM weights and state: fp32, bf16 "
                                            "or fp16 (default fp32; log-probs stay float32)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for PyTorch (default: all cores)."),
    batching: Optional[bool] = typer.Option(None, "--batching/--no-batching", help="Dynamic batching (default on)."),
    frontends: Optional[int] = typer.Option(None, "--frontends", help="Front-end processes for the requests "
                                            "(env SMALLSTATE_FRONTENDS; default: the CPUs this process may use, "
                                            "less one for the engine, at least 1)."),
    set_: List[str] = typer.Option([], "--set", help="Any other setting key=value, e.g. --set max_wait_ms=10 "
                                   "(see docs/service.md; env SMALLSTATE_<KEY> works too)."),
):
    """Serve rescoring over HTTP (FastAPI + uvicorn): POST /rescore, /score; GET /healthz, /readyz, /metrics.
    Runs as a supervisor, one engine process (the model) and front-end processes (the requests)."""
    from ..service import Settings
    from ..service import serve as run_server

    options = {"lm": str(lm) if lm else None, "ngram": str(ngram) if ngram else None,
               "weights": str(weights) if weights else None, "host": host, "port": port, "device": device,
               "precision": precision, "threads": threads, "batching": batching, "frontends": frontends}
    settings = Settings.from_env(assignments=set_, **options)
    run_server(settings)
