"""Type and range checks of one recipe node against the class it configures.

One mechanism for every node of a recipe, run before any Ray work:

- A dataclass (a component config such as `OptimConfig`, or a schema of plain
  recipe keys such as `RunConfig`): pydantic validates the node against the
  field types, nested dataclasses included, and the ranges they declare
  (`Annotated[float, Gt(0)]`, `Literal[...]`: `unirl.types.constraints`, worded as the
  config's own `check_fields` words them), then runs the dataclass's `__post_init__`,
  where the checks that span several fields live.
- Any other class: pydantic validates the keyword arguments the node gives
  against the constructor's type hints, `Annotated[int, Ge(1)]` constraints
  included. The constructor's own checks run when the validator builds the
  class (`unirl.config.validate`).

Validation is strict, as a recipe's values are already typed by YAML and Hydra's
override grammar: "abc" or "5" is not an int, 2.5 is not an int, true is not an
int; an int is a float and a list is a tuple. Keys the class does not take are
reported. A value that holds a nested `_target_` is checked as its own node,
not as a value of its parent.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import typing
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError, create_model

from unirl.types.constraints import describe_error, field_problem

# keys Hydra's `instantiate` reads; they are not arguments of the target
HYDRA_KEYS = ("_target_", "_convert_", "_recursive_", "_partial_", "_args_")


def holds_target(value: Any) -> bool:
    """True when `value` is, or contains, a `_target_` node."""
    if isinstance(value, dict):
        return "_target_" in value or any(holds_target(v) for v in value.values())
    if isinstance(value, list):
        return any(holds_target(v) for v in value)
    return False


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field hint names, alone or in an Optional / union; else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _unknown_keys(cls: type, values: dict, path: str) -> list[str]:
    """A problem for every key of `values` that no init field of dataclass `cls` takes (recursively)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    problems = []
    for key, value in values.items():
        if key in HYDRA_KEYS:
            continue
        full_key = f"{path}.{key}" if path else key
        if key not in fields:
            problems.append(f"{full_key}: unknown key; {cls.__name__} takes {sorted(fields)}")
            continue
        nested = _dataclass_of(fields[key])
        if nested is not None and isinstance(value, dict):
            problems.extend(_unknown_keys(nested, value, full_key))
    return problems


def target_parameters(target: Any) -> list[inspect.Parameter]:
    """The parameters a recipe node can give `target` (a class's constructor or a function)."""
    if isinstance(target, type):
        return list(inspect.signature(target.__init__).parameters.values())[1:]
    return list(inspect.signature(target).parameters.values())


def _checkable(hint: Any) -> bool:
    """True when pydantic can build a validator for `hint` (not, e.g., for a plain Protocol)."""
    try:
        TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # noqa: BLE001 - schema generation fails in several ways
        return False
    return True


@functools.cache
def _signature_adapter(cls: Any) -> tuple[TypeAdapter, tuple[str, ...]]:
    """A pydantic adapter of `cls`'s keyword arguments, and the arguments whose hint cannot be checked.

    Every argument is optional here: the recipe may leave one to its default
    or to the caller (the stage an engine is built with). Unknown keys are
    rejected unless `cls` takes **kwargs.
    """
    params = target_parameters(cls)
    try:
        hints = typing.get_type_hints(cls.__init__ if isinstance(cls, type) else cls, include_extras=True)
    except NameError:
        hints = {}
    fields: dict[str, Any] = {}
    unchecked = []
    extra = "forbid"
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            extra = "allow"
        elif param.kind is not param.VAR_POSITIONAL:
            hint = hints.get(param.name, Any)
            if param.name not in hints or not _checkable(hint):
                unchecked.append(param.name)
                hint = Any
            fields[param.name] = (hint, None if param.default is param.empty else param.default)
    config = ConfigDict(extra=extra, arbitrary_types_allowed=True)
    model = create_model(f"{cls.__name__}Arguments", __config__=config, **fields)
    return TypeAdapter(model), tuple(unchecked)


@functools.cache
def _dataclass_adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def _key(path: str, values: Any, loc: tuple) -> str:
    """The recipe key of a pydantic error location; union-member tags in `loc` are dropped."""
    key, node = path, values
    for i, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            key, node = f"{key}[{part}]", node[part]
        elif isinstance(node, dict) and (part in node or i == len(loc) - 1):  # last: a missing key
            key, node = f"{key}.{part}" if key else str(part), node.get(part)
    return key


def range_problem(cls: type, error: dict, key: str) -> str | None:
    """A pydantic error against a range a dataclass field's type declares, worded as the config's
    own `check_fields` words it (the whole declared range: `in (0, 1)`); None for other errors."""
    loc = error["loc"]
    if dataclasses.is_dataclass(cls) and len(loc) == 1 and loc[0] in {f.name for f in dataclasses.fields(cls)}:
        hint = typing.get_type_hints(cls, include_extras=True)[loc[0]]
        problem = field_problem(key, hint, error["input"])
        if problem:
            return problem
    return describe_error(key, error)


def _problem(path: str, cls: type, values: dict, error: dict) -> str:
    key = _key(path, values, error["loc"])
    if error["type"] == "missing":
        return f"{key}: missing; {cls.__name__} needs it"
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key; {cls.__name__} takes {[p.name for p in target_parameters(cls)]}"
    if error["type"] == "value_error":  # a range check of __post_init__: its message names its keys
        message = str(error["ctx"]["error"])
        parent, _, section = key.rpartition(".")
        if parent and message.startswith(section + "."):  # "sampling.x" checked at eval.sampling
            message = f"{parent}.{message}"
        return message if message.startswith(key) else f"{key or cls.__name__}: {message}"
    ranged = range_problem(cls, error, key)  # a range the type declares (unirl.types.constraints)
    if ranged:
        return ranged
    expected = error["msg"].removeprefix("Input should be ")
    return f"{key}: expected {expected}, got {error['input']!r}"


def check_node(path: str, cls: type, values: dict) -> tuple[Any, list[str]]:
    """Check the plain `values` of the node at `path` against `cls`.

    Returns (the dataclass instance when `cls` is a dataclass and every check
    passed, else None; the problems, each naming its full key, the value and
    what is expected).
    """
    args = {k: v for k, v in values.items() if k not in HYDRA_KEYS}
    problems: list[str] = []
    if dataclasses.is_dataclass(cls):
        problems.extend(_unknown_keys(cls, args, path))
        adapter = _dataclass_adapter(cls)
    else:
        args = {k: v for k, v in args.items() if not holds_target(v)}
        adapter, unchecked = _signature_adapter(cls)
        problems.extend(
            f"{path}.{k}: {cls.__name__}({k}=...) has no type hint that can be checked (missing, "
            "not importable at module level, or a plain Protocol); give it one, or set the key "
            "to a _target_ node"
            for k in args
            if k in unchecked
        )
    try:
        instance = adapter.validate_json(json.dumps(args), strict=True)
    except ValidationError as exc:
        seen = set()
        for error in exc.errors():
            problem = _problem(path, cls, args, error)
            if problem not in seen:
                seen.add(problem)
                problems.append(problem)
        return None, problems
    return (instance if dataclasses.is_dataclass(cls) and not problems else None), problems
