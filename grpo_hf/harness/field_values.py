"""A recipe's values checked against their fields' annotations, by name, whatever gave them (a YAML file or the
command line): [`check_value`].
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

from ..errors import RecipeError


@functools.cache
def _type_hints(dtype: type) -> dict[str, Any]:
    return typing.get_type_hints(dtype)


def _options(dtype: type, field: dataclasses.Field) -> tuple:
    """The types a field's annotation admits (the members of a union), plus `bool` for a flag whose bare option is
    `True` (the Trainer's `fsdp`: `fsdp=True` turns it on)."""
    hint = _type_hints(dtype)[field.name]
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return (*options, bool) if field.metadata.get("const") is True else options


def _describe_type(option) -> str:
    origin = typing.get_origin(option)
    if option is bool:
        return "true or false"
    if option is int:
        return "a whole number"
    if option is float:
        return "a number"
    if option is str:
        return "a string"
    if origin is list:
        (element,) = typing.get_args(option) or (Any,)
        return f"a list of {_describe_type(element).removeprefix('a ').removeprefix('an ')}s"
    if option is dict or origin is dict:
        return "a mapping"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(option))}"
    if isinstance(option, type) and issubclass(option, enum.Enum):
        return f"one of {[member.value for member in option]}"
    return getattr(option, "__name__", str(option))


_NO_MATCH = object()


def _match(value, option):
    """`value` as `option` (an int as a float, the elements of a list checked), or `_NO_MATCH`."""
    origin = typing.get_origin(option)
    if option is Any:
        return value
    if option is type(None):
        return value if value is None else _NO_MATCH
    if option is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if option is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if option is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO_MATCH
    if option is str:
        return value if isinstance(value, str) else _NO_MATCH
    if isinstance(option, type) and issubclass(option, enum.Enum):  # the dataclass converts (and checks) a name
        return value if isinstance(value, (option, str)) else _NO_MATCH
    if origin is typing.Literal:
        return value if value in typing.get_args(option) else _NO_MATCH
    if option is dict or origin is dict:
        return value if isinstance(value, dict) else _NO_MATCH
    if origin is list:  # one value alone is a list of one, as `--lora_target_modules q_proj` gives
        (element,) = typing.get_args(option) or (Any,)
        items = [_match_or_text(item, (element,)) for item in (value if isinstance(value, list) else [value])]
        return _NO_MATCH if any(item is _NO_MATCH for item in items) else items
    if isinstance(option, type):
        return value if isinstance(value, option) else _NO_MATCH
    return value  # an annotation this check does not know: the dataclass decides


def _match_or_text(value, options: tuple):
    """The first option `value` matches; else, for a field that takes text, a YAML number as the text it was written
    as (`grpo_bits: 4` is `"4"`, as on the command line); else `_NO_MATCH`."""
    for option in options:
        matched = _match(value, option)
        if matched is not _NO_MATCH:
            return matched
    if str in options and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _NO_MATCH


def check_value(dtype: type, field: dataclasses.Field, value):
    """
    A recipe value checked against its field's annotation, by name, whatever gave it (a YAML file, where values keep
    the type YAML reads, or the command line): returned as the field takes it (an integer as a float for a float
    field, a YAML number as text for a text field); the field's default passes as is.

    Raises:
        [`RecipeError`]: a list where one value belongs (`seed: [0, 1, 2]`), a mapping, text or `true` where a number
            belongs, `null` for a field that needs a value; naming the field, the value and what it takes.
    """
    default = field.default
    if default is not dataclasses.MISSING and type(value) is type(default) and value == default:
        return value
    options = _options(dtype, field)
    matched = _match_or_text(value, options)
    if matched is not _NO_MATCH:
        return matched
    wanted = " or ".join(dict.fromkeys(_describe_type(o) for o in options if o is not type(None)))
    if value is None:
        problem = f"no value (null), and {field.name} needs one"
    elif isinstance(value, list):
        problem = f"a list where {wanted} belongs (one value per field)"
    elif isinstance(value, dict):
        problem = f"a mapping where {wanted} belongs"
    elif isinstance(value, str):
        problem = f"text where {wanted} belongs"
    else:
        kind = type(value).__name__
        problem = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} where {wanted} belongs"
    raise RecipeError(f"{field.name}={value!r}: {problem}. Give {wanted}.")


__all__ = ["check_value"]
