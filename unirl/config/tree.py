"""Phase 1 of recipe validation: every node of the recipe tree, on its own.

`check_recipe` resolves the recipe and checks each node against the class it configures, with
the same mechanism for every node (`unirl.config.schema.check_node`): the top level and the
plain sections against their schemas (`unirl.config.run`), every `_target_` node against its
target; a target the recipe alone can build is built, so its constructor's own checks run too.
Nothing here knows what any component means: the rules between components (phase 2) live in
the modules `unirl.config.validate` composes.
"""

from __future__ import annotations

import functools
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from unirl.config.schema import HYDRA_KEYS, check_node, target_parameters


class ConfigError(ValueError):
    """A recipe is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def target_nodes(node: Any, path: str = "") -> list[tuple[str, dict]]:
    """(key path, node) of every `_target_` node in a plain config tree, innermost first."""
    found = []
    if isinstance(node, dict):
        for key, child in node.items():
            found.extend(target_nodes(child, f"{path}.{key}" if path else str(key)))
        if "_target_" in node:
            found.append((path, node))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(target_nodes(item, f"{path}[{i}]"))
    return found


def target_class(cfg: DictConfig, key: str) -> type | None:
    """The class `cfg[key]._target_` names, or None when it is missing or unknown (which
    `check_recipe` reports)."""
    try:
        return get_object(cfg[key]["_target_"])
    except Exception:  # noqa: BLE001 - a missing or unknown target is reported by check_recipe
        return None


def _node_at(tree: dict, path: str) -> Any:
    node: Any = tree
    for part in path.split(".") if path else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _buildable(target: Any, node: dict) -> bool:
    """True when the recipe node gives every argument the target requires (nothing is injected later)."""
    return all(
        p.name in node or p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in target_parameters(target)
    )


def _child(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key


def build_resolved(node: Any, path: str = "", built: dict[str, Any] | None = None) -> Any:
    """`hydra.utils.instantiate(node, _convert_="all")` of a resolved plain node (dicts and lists,
    as `OmegaConf.to_container(resolve=True)` gives), without Hydra's round trip through
    OmegaConf: a `_target_` node is called with its built children (`_args_` positionally,
    `_partial_` as `functools.partial`), other dicts and lists stay plain containers of built
    values. `built` maps the key path of a `_target_` node already built (or checked into an
    instance) to that object, which is used instead of building it again. A node that sets
    `_recursive_` or `_convert_` is handed to Hydra itself. A constructor's error propagates
    unwrapped (Hydra would chain it as the `__cause__` of its own)."""
    built = {} if built is None else built
    if isinstance(node, list):
        return [build_resolved(v, _child(path, i), built) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if "_target_" not in node:
        return {k: build_resolved(v, _child(path, k), built) for k, v in node.items()}
    if path in built:
        return built[path]
    if "_recursive_" in node or "_convert_" in node:
        return instantiate(node, _convert_="all")
    target = get_object(node["_target_"])
    args = [
        build_resolved(v, _child(path, f"_args_[{i}]"), built) for i, v in enumerate(node.get("_args_", []))
    ]
    kwargs = {k: build_resolved(v, _child(path, k), built) for k, v in node.items() if k not in HYDRA_KEYS}
    return functools.partial(target, *args, **kwargs) if node.get("_partial_") else target(*args, **kwargs)


def _build(node: dict, path: str, problems: list[str], built: dict[str, Any]) -> Any:
    try:
        return build_resolved(node, path, built)
    except Exception as exc:  # noqa: BLE001 - report the component and its error, then keep checking
        cause = (exc.__cause__ or exc) if isinstance(exc, InstantiationException) else exc
        problems.append(f"{path}: {type(cause).__name__}: {cause}")
        return None


def check_recipe(cfg: DictConfig, sections: dict[str, type], problems: list[str]) -> dict[str, Any]:
    """Type- and range-check every node of `cfg`; append a problem for each failure.

    `sections` maps the path of each plain node ("" for the top level) to its
    schema dataclass. Returns {path: object} for every node that passed: the
    schema or dataclass instance, or the built class; None for a class that
    needs arguments only the trainer has (a stage needs its model bundle).
    """
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001 - an interpolation that does not resolve stops everything
        problems.append(f"the recipe does not resolve: {type(exc).__name__}: {exc}")
        return {}
    passed: dict[str, Any] = {}
    for path, schema in sections.items():
        node = _node_at(tree, path)
        if node is None:
            continue  # an optional section left out; a required one is named by its parent's schema
        if not isinstance(node, dict):
            problems.append(f"{path}: expected a mapping ({schema.__name__}), got {node!r}")
            continue
        instance, found = check_node(path, schema, node)
        problems.extend(found)
        if not found:
            passed[path] = instance
    failed: list[str] = []
    built: dict[str, Any] = {}  # the target nodes that passed, innermost first: reused by their parents
    for path, node in target_nodes(tree):
        try:
            target = get_object(node["_target_"])
        except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
            problems.append(
                f"{path}._target_: unknown _target_ {node['_target_']!r} ({type(exc).__name__}: {exc}); "
                "check the class path"
            )
            failed.append(path)
            continue
        instance, found = check_node(path, target, node)
        if not found and instance is None and _buildable(target, node):
            if any(f.startswith(path + ".") or f.startswith(path + "[") for f in failed):
                continue  # a nested node failed and is reported; building would repeat it
            instance = _build(node, path, found, built)
        problems.extend(found)
        if found:
            failed.append(path)
        else:
            passed[path] = instance
            if instance is not None:
                built[path] = instance
    return passed
