"""Typer options made from the fields of a config dataclass (`TrainConfig`, `DistillConfig`: fields declared
with `option()`), so that a new field is a new option without a second list to keep in step."""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, List, Literal, Optional, Union, get_args, get_origin, get_type_hints

import typer

from .common import parse_overrides


def _option_type(hint, path: bool):
    """The type Typer parses an option into, for a config field of type `hint`."""
    if get_origin(hint) in (Union, types.UnionType):  # `X | None`
        return Optional[_option_type(next(a for a in get_args(hint) if a is not type(None)), path)]
    if path:
        return Path
    if get_origin(hint) is Literal:
        return str  # the library checks the value, in one message naming the choices
    if get_origin(hint) is list:
        return List[get_args(hint)[0]]
    return List[str] if hint is dict else hint  # a dict is given as repeated key=value (parse_overrides)


def options(cls, changes: dict[str, dict] | None = None) -> dict[str, inspect.Parameter]:
    """The Typer options of the fields of config dataclass `cls` made with `option()`, by
    field name, in field order. `changes` replaces some of a field's option settings
    (default, help, flags) for one command."""
    hints = get_type_hints(cls)
    params = {}
    for f in dataclasses.fields(cls):
        if "cli" not in f.metadata:
            continue
        spec = {**f.metadata["cli"], **(changes or {}).get(f.name, {})}
        default = spec.get("default", f.default_factory() if f.default_factory is not dataclasses.MISSING
                           else f.default)
        if spec["negated"]:
            name, kind, default = spec["negated"], bool, not default
        else:
            name, kind = f.name, _option_type(hints[f.name], spec["path"])
            default = [] if isinstance(default, dict) else default  # a dict: no --set pairs by default
        params[f.name] = inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, typer.Option(*spec["flags"],
                                                                                          help=spec["help"])],
            default=inspect.Parameter.empty if default is dataclasses.MISSING else default)
    return params


def config(cls, values: dict):
    """An instance of config dataclass `cls` from the values of its options (`options`);
    fields without a value keep their defaults."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("cli")
        if spec is None or (spec["negated"] or f.name) not in values:
            continue
        value = values[spec["negated"] or f.name]
        if spec["negated"]:
            value = not value
        elif hints[f.name] is dict:
            value = parse_overrides(value)
        elif isinstance(value, (list, tuple)):
            value = list(value)
        elif spec["path"] and value is not None:
            value = str(value)
        kwargs[f.name] = value
    return cls(**kwargs)


_THREADS = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
    Optional[int], typer.Option(help="CPU threads for PyTorch [default: all cores].")])


def signature(params: Iterable[inspect.Parameter]) -> Callable:
    """Give a command that takes `**options` the signature Typer reads its options from (and `--threads`)."""
    def wrap(fn: Callable) -> Callable:
        fn.__signature__ = inspect.Signature([*params, _THREADS])
        return fn

    return wrap
