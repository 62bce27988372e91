"""Typed ranges of config fields, declared once and checked wherever a config is made.

A config dataclass declares a field's range in its type, with `annotated_types`:
`beta: Annotated[float, Gt(0)]`, `clip_range: Annotated[float, Interval(gt=0, lt=1)] | None`,
`weighting: Literal["uniform", "t"]`, and a note on what a bound value means with
`annotated_types.doc` (`Annotated[float, Ge(0), doc("0: greedy")]`, quoted after the range in
the message). Two places read the declaration:

- the recipe validator (`unirl.config.schema`): pydantic enforces it before the config is
  built, and a failure reads `<key> must be > 0, got -1.0` (`describe_error`);
- the config's own `__post_init__` calls `check_fields(self, "algorithm.config.")`, so a config
  built in code is held to the same ranges, and a float bound also refuses inf and NaN.

Nothing else is hand-written: a range lives in the type, and the message follows from it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Annotated, Any, Literal

from annotated_types import DocInfo, Ge, Gt, Interval, Le, Lt

Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
AtLeastOne = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
OpenUnit = Annotated[float, Interval(gt=0, lt=1)]  # (0, 1)

_OPS = {"gt": (">", lambda v, b: v > b), "ge": (">=", lambda v, b: v >= b)}
_OPS |= {"lt": ("<", lambda v, b: v < b), "le": ("<=", lambda v, b: v <= b)}


def _bounds(meta: Any) -> dict[str, Any]:
    """The bounds of one annotated_types constraint, as {"gt" | "ge" | "lt" | "le": bound}."""
    if isinstance(meta, Interval):
        return {k: getattr(meta, k) for k in ("gt", "ge", "lt", "le") if getattr(meta, k) is not None}
    for kind, attr in ((Gt, "gt"), (Ge, "ge"), (Lt, "lt"), (Le, "le")):
        if isinstance(meta, kind):
            return {attr: getattr(meta, attr)}
    return {}


def _number(bound: Any) -> Any:
    """A bound as it is written: `1` for 1.0 too. typing caches `Annotated[float, Ge(1)]` and
    `Annotated[float, Ge(1.0)]` as one (the bounds compare equal), so which spelling a field sees
    depends on import order; the message must not."""
    return int(bound) if isinstance(bound, float) and bound.is_integer() else bound


def describe(bounds: dict[str, Any]) -> str:
    """`> 0`, `>= 1`, or an interval `in (0, 1]`."""
    bounds = {op: _number(bound) for op, bound in bounds.items()}
    if len(bounds) == 1:
        ((op, bound),) = bounds.items()
        return f"{_OPS[op][0]} {bound}"
    low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds.get("ge"))
    high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds.get("le"))
    return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"


def _parts(hint: Any) -> tuple[dict[str, Any], tuple | None, bool, str]:
    """(the bounds, the Literal choices or None, whether None is allowed, the doc note) of a
    field's hint."""
    bounds: dict[str, Any] = {}
    choices, optional, note = None, False, ""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)
    for arg in args:
        if arg is type(None):
            optional = True
        elif typing.get_origin(arg) is Annotated:
            for meta in arg.__metadata__:
                bounds |= _bounds(meta)
                note = f" ({meta.documentation})" if isinstance(meta, DocInfo) else note
        elif typing.get_origin(arg) is Literal:
            choices = typing.get_args(arg)
    return bounds, choices, optional, note


def field_problem(name: str, hint: Any, value: Any) -> str | None:
    """Why `value` is outside the range `hint` declares for field `name`, or None."""
    bounds, choices, optional, note = _parts(hint)
    if value is None:
        return None if optional or not (bounds or choices) else f"{name} must not be null"
    null = " or null" if optional else ""
    if choices is not None and value not in choices:
        return f"{name} must be one of {list(choices)}{null}, got {value!r}"
    if not bounds or not isinstance(value, int | float) or isinstance(value, bool):
        return None
    finite = not isinstance(value, float) or math.isfinite(value)
    if not finite or not all(_OPS[op][1](value, b) for op, b in bounds.items()):
        return f"{name} must be {describe(bounds)}{note}{null}, got {value}"
    return None


def check_fields(config: Any, prefix: str = "") -> None:
    """Raise ValueError naming `prefix + field`, the range and the value for the first field of
    dataclass `config` outside the range its type declares (bounds, a Literal's choices)."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    for f in dataclasses.fields(config):
        problem = field_problem(prefix + f.name, hints[f.name], getattr(config, f.name))
        if problem:
            raise ValueError(problem)


def describe_error(key: str, error: dict[str, Any]) -> str | None:
    """A pydantic error of a declared range as `check_fields` words it (`<key> must be > 0, got
    -1.0`), or None for any other error."""
    ctx = error.get("ctx") or {}
    kinds = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}
    if error["type"] in kinds:
        op = kinds[error["type"]]
        return f"{key} must be {describe({op: ctx[op]})}, got {error['input']}"
    if error["type"] == "literal_error":
        return f"{key} must be {ctx['expected']}, got {error['input']!r}"
    return None
