"""Dependencies point one way, and only a model family's own package names it.

types <- sde <- models <- (rollout, reward, algorithms) <- train <- distributed <- trainer <- config
<- entry points. `config` (the recipe validators) checks every component, so it sits above them all
and nothing but an entry point imports it; `data` and `tracking` are leaf utilities; nothing imports a
world (`worlds/`, beside the package). Every module under unirl/ is parsed with `ast`; nothing
is imported, so the check is fast and cannot be fooled by import side effects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "unirl"

CORE = ["types", "sde", "models"]
MIDDLE = ["rollout", "reward", "algorithms"]
UTILS = {"data", "tracking"}
ENTRY = "<entry>"  # unirl/train_*.py, unirl/evaluate.py, unirl/view.py, unirl/plan_memory.py and unirl/entry.py (what the RL entry points share)
ENTRY_MODULES = ("evaluate", "entry", "view", "plan_memory")
# entry points that live beside their package: `python -m unirl.reward.server`, `python -m unirl.train`
# (nothing imports them)
ENTRY_SUBMODULES = ("unirl.reward.server", "unirl.train.__main__")

ALLOWED: dict[str, set[str]] = {
    "types": {"types"},
    "sde": {"types", "sde"},
    "models": {"types", "sde", "models"},
    # the middle layer may use the core but not each other, nor the utilities
    **{m: {*CORE, m} for m in MIDDLE},
    "train": {*CORE, *MIDDLE, "train", *UTILS},
    "distributed": {*CORE, *MIDDLE, "train", "distributed", *UTILS},
    # the data plane moves batches of the typed boundary (over Ray); drivers and workers use it
    "dataplane": {"types", "distributed", "dataplane"},
    # the weight plane (trainer -> dedicated engine weights) needs only the device choice
    "sync": {"distributed", "sync"},
    "trainer": {*CORE, *MIDDLE, "train", "distributed", "dataplane", "sync", "trainer", *UTILS},
    "data": {"types", "data"},
    "tracking": {"tracking"},
    "config": {*CORE, *MIDDLE, "train", "distributed", "dataplane", "sync", "trainer", *UTILS, "config"},
    # entry points sit on top
    ENTRY: {*CORE, *MIDDLE, "train", "distributed", "dataplane", "sync", "trainer", "config", *UTILS, ENTRY},
    "": set(),  # unirl/__init__.py stays import-free
}
# third-party packages the pure layers must not pull in
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "types": {"ray", "hydra", "omegaconf", "diffusers", "transformers"},
    "sde": {"ray", "hydra", "omegaconf", "diffusers", "transformers"},
}


def layer_of(module: str) -> str:
    """'unirl.sde.strategies' -> 'sde'; 'unirl.train_diffusion' -> ENTRY; 'unirl' -> ''."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    top = parts[1]
    if module in ENTRY_SUBMODULES:
        return ENTRY
    return ENTRY if top.startswith("train_") or top in ENTRY_MODULES else top


def module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def imported_modules(module: str, is_pkg: bool, source: str) -> list[tuple[str, int]]:
    """(imported module, line) pairs for every import anywhere in the file, incl. function bodies."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the current package
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            # `from unirl import sde` imports the package unirl.sde
            if target == "unirl":
                out += [(f"unirl.{alias.name}", node.lineno) for alias in node.names]
    return out


def violations(module: str, is_pkg: bool, source: str) -> list[str]:
    src = layer_of(module)
    bad: list[str] = []
    if src not in ALLOWED:
        return [f"{module}: no layer rule for package unirl.{src} (add it to ALLOWED)"]
    for target, line in imported_modules(module, is_pkg, source):
        top = target.split(".")[0]
        if top in FORBIDDEN_EXTERNAL.get(src, set()):
            bad.append(f"{module}:{line} -> {target} (third-party {top!r} in a pure layer)")
        if top == "worlds":  # the framework knows no world: recipes reach one by `_target_`
            bad.append(f"{module}:{line} -> {target} (unirl may not import a world)")
        if top != "unirl" or target == "unirl":
            continue
        dst = layer_of(target)
        if dst not in ALLOWED:
            bad.append(f"{module}:{line} -> {target} (no layer rule for unirl.{dst})")
        elif dst not in ALLOWED[src]:
            bad.append(f"{module}:{line} -> {target} ({src or 'unirl'} may not import {dst})")
    return bad


def all_modules() -> list[tuple[str, bool, str]]:
    return [(*module_name(p), p.read_text(encoding="utf-8")) for p in sorted(PKG.rglob("*.py"))]


def test_parser_sees_the_package() -> None:
    mods = {m for m, _, _ in all_modules()}
    assert {"unirl", "unirl.types", "unirl.types.batch", "unirl.sde.strategies"} <= mods
    layers = {layer_of(m) for m in mods}
    assert {"types", "sde", "models", "trainer", ENTRY} <= layers
    edges = {
        (layer_of(m), layer_of(t))
        for m, pkg, src in all_modules()
        for t, _ in imported_modules(m, pkg, src)
        if t.startswith("unirl.")
    }
    # the checker must observe real edges, or the direction test would pass vacuously
    assert ("sde", "types") in edges and ("models", "sde") in edges


def test_layer_order() -> None:
    bad = [v for m, pkg, src in all_modules() for v in violations(m, pkg, src)]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "is_pkg", "source", "expected"),
    [
        ("unirl.types.batch", False, "from unirl.sde import x\n", "types may not import sde"),
        ("unirl.types", True, "def f():\n    import unirl.models.sd3.stage\n", "types may not import models"),
        ("unirl.sde.strategies", False, "from unirl import trainer\n", "sde may not import trainer"),
        (
            "unirl.models.sd3.stage",
            False,
            "from ...rollout import trainside\n",
            "models may not import rollout",
        ),
        (
            "unirl.reward.service",
            False,
            "from unirl.algorithms.base import A\n",
            "reward may not import algorithms",
        ),
        ("unirl.rollout.trainside", False, "from unirl.data import x\n", "rollout may not import data"),
        ("unirl.data.datasets", False, "import unirl.sde\n", "data may not import sde"),
        ("unirl.tracking.metrics", False, "from unirl.types import x\n", "tracking may not import types"),
        ("unirl.reward.judge", False, "from worlds.shapes.vqa import q\n", "unirl may not import a world"),
        ("unirl.models.sd3", True, "from unirl.config import x\n", "models may not import config"),
        (
            "unirl.trainer.trainer",
            False,
            "from unirl.train_diffusion import main\n",
            "may not import <entry>",
        ),
        ("unirl.sde.schedules", False, "import ray\n", "third-party 'ray'"),
        ("unirl.sde.schedules", False, "from unirl.newpkg import x\n", "no layer rule for unirl.newpkg"),
    ],
)
def test_checker_flags_violations(module: str, is_pkg: bool, source: str, expected: str) -> None:
    bad = violations(module, is_pkg, source)
    assert any(expected in v for v in bad), bad


@pytest.mark.parametrize(
    ("module", "is_pkg", "source"),
    [
        ("unirl.sde.strategies", False, "from unirl.types.sampling import x\nimport torch\n"),
        ("unirl.models.sd3.stage", False, "from ..base import x\nfrom unirl.sde import y\n"),
        ("unirl.trainer.trainer", False, "from unirl.tracking import m\nfrom unirl.distributed import g\n"),
        ("unirl.train_diffusion", False, "from unirl.config import v\nfrom unirl.trainer import t\n"),
        ("unirl.config.validate", False, "from unirl.trainer import t\n"),
    ],
)
def test_checker_accepts_allowed_edges(module: str, is_pkg: bool, source: str) -> None:
    assert violations(module, is_pkg, source) == []


def test_relative_import_resolution() -> None:
    got = imported_modules("unirl.models.sd3.stage", False, "from . import bundle\nfrom ..base import X\n")
    assert [t for t, _ in got] == ["unirl.models.sd3", "unirl.models.base"]
    got = imported_modules("unirl.models.sd3", True, "from .bundle import B\n")
    assert [t for t, _ in got] == ["unirl.models.sd3.bundle"]


# Model families (unirl/models/README.md): a family lives in its own package under unirl/models/,
# and nothing outside that package imports it; recipes and entry points name it by `_target_`
# strings. The packages there that every family shares are not families.
SHARED_MODELS = {"flow", "causal_lm", "image_tokens"}  # the shared stages and their family contracts


def family_of(module: str) -> str | None:
    """'unirl.models.sd3.bundle' -> 'sd3'; None for anything that is not inside a family package."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["unirl", "models"] or parts[2] in SHARED_MODELS:
        return None
    return parts[2] if (PKG / "models" / parts[2] / "__init__.py").exists() else None


def family_violations(module: str, is_pkg: bool, source: str) -> list[str]:
    """Imports of a family package, and dotted-path strings naming one (`get_object` targets),
    from outside it; entry points may name a family by a `_target_` string."""
    own = family_of(module)
    bad = [
        f"{module}:{line} -> {target} (only unirl/models/{fam}/ imports the {fam} family)"
        for target, line in imported_modules(module, is_pkg, source)
        if (fam := family_of(target)) is not None and fam != own
    ]
    if layer_of(module) != ENTRY:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
                fam = family_of(node.value)
                if fam is not None and fam != own:
                    bad.append(f"{module}:{node.lineno} names {node.value!r} (a {fam} family path)")
    return bad


def test_families_are_found() -> None:
    families = {p.parent.name for p in (PKG / "models").glob("*/__init__.py")} - SHARED_MODELS
    assert "sd3" in families and family_of("unirl.models.sd3.bundle") == "sd3"


def test_generic_code_names_no_family() -> None:
    bad = [v for m, pkg, src in all_modules() for v in family_violations(m, pkg, src)]
    assert not bad, "a family named outside its package (name it by a `_target_` in a recipe):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("unirl.trainer.evaluation", "from unirl.models.sd3 import SD3Stage\n", "only unirl/models/sd3/"),
        ("unirl.models.flow.stage", "def f():\n    import unirl.models.sd3.bundle\n", "only unirl/models/sd3/"),
        ("unirl.config.geometry", "T = 'unirl.models.sd3.SD3ModelConfig'\n", "a sd3 family path"),
    ],
)
def test_family_checker_flags(module: str, source: str, expected: str) -> None:
    assert any(expected in v for v in family_violations(module, False, source))


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("unirl.models.sd3.bundle", "from unirl.models.sd3.other import x\nfrom unirl.models.flow import F\n"),
        ("unirl.evaluate", "BASE = 'unirl.models.sd3.SD3ModelConfig'\n"),
        ("unirl.trainer.evaluation", "from unirl.models.flow.stage import FlowMatchingStage\n"),
    ],
)
def test_family_checker_accepts(module: str, source: str) -> None:
    assert family_violations(module, False, source) == []


def test_every_family_is_a_config_and_a_bundle() -> None:
    """A family folder holds `config.py` (the model config, data) and `bundle.py` (the modeling
    the config names); the config never imports its bundle at module level (it names it, or
    imports it inside the calls that build), so reading a recipe's model node loads no modeling."""
    families = sorted({p.parent.name for p in (PKG / "models").glob("*/__init__.py")} - SHARED_MODELS)
    assert {"sd3", "qwen", "qwen_vl", "janus"} <= set(families)
    bad = []
    for fam in families:
        folder = PKG / "models" / fam
        missing = [f for f in ("config.py", "bundle.py") if not (folder / f).exists()]
        if missing:
            bad.append(f"unirl/models/{fam}/ lacks {missing}")
            continue
        tree = ast.parse((folder / "config.py").read_text(encoding="utf-8"))
        for node in tree.body:  # module-level statements only
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"unirl.models.{fam}.bundle"):
                bad.append(f"unirl/models/{fam}/config.py:{node.lineno} imports its bundle at module level")
    assert not bad, "\n".join(bad)
