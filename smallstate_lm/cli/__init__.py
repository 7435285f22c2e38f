"""`smallstate-lm` command line: each command parses its options, calls one library function and formats
the result; one module per command group, registered here in the order `--help` lists them. Errors meant for
users print as one line and exit with status 2."""

from __future__ import annotations

import os
import sys

import typer

from ..errors import SmallstateError
from . import demo, evaluate, ngram, rescore, serve, tasks, train, tune
from .common import parse_overrides

__all__ = ["app", "main", "parse_overrides"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Small-state Transformer LMs for ASR rescoring.")
app.command()(train.train)
app.command("eval")(evaluate.eval_)
app.command()(evaluate.export)
app.command()(demo.demo)
app.command()(rescore.rescore)
app.command()(tune.tune)
app.command()(rescore.wer)
app.command()(serve.serve)
app.command()(train.distill)
app.command()(tasks.tasks)
app.add_typer(ngram.app, name="ngram")


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv)
    except SmallstateError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a bug of ours: still one line for the user, traceback on request
        if os.environ.get("SMALLSTATE_DEBUG"):
            raise
        print(f"error: internal error {type(e).__name__}: {e} (set SMALLSTATE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        sys.exit(3)
