"""Type checks for `config.json` values against a config dataclass's annotations, before the model is built.

A wrong-typed value (a string where an int belongs) would otherwise surface as a TypeError deep inside a module's
constructor; here it becomes one FastRemoverError naming the key, its value and the expected type.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields

from fastremover.errors import FastRemoverError


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, h) for v, h in zip(value, args))
        item = args[0] if args else typing.Any
        return all(_matches(v, item) for v in value)
    if hint is typing.Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this checker does not know: left to the dataclass


def _describe(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "null")
    return text.replace("<class '", "").replace("'>", "")


def check_config_types(cls, given: dict, what: str) -> None:
    """FastRemoverError for the first key of `given` whose value does not match its field's annotation in `cls`."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in given and not _matches(given[f.name], hints[f.name]):
            raise FastRemoverError(
                f"{what} config.json: {f.name} = {given[f.name]!r} has the wrong type (expected {_describe(hints[f.name])});"
                " fix the file or re-download the checkpoint"
            )
