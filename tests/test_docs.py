"""The docs say true things about the code.

For the top README, every package README under unirl/ and worlds/, benchmarks/README.md, the committed
checkpoints' TRAINING.md and every page under docs/:

- every relative markdown link resolves to a file (and its `#anchor`, when given, to a heading of
  that file);
- every code symbol named in backticks exists: a dotted path `unirl.a.b.Name[.attr]` (or `worlds.`), a file
  `name.py` or `path/to/name.py`, a committed path `dir/name.md|yaml|sh|toml` (globs allowed), a recipe `--config-name=<domain>/<name>` (in prose or in a code
  block), a module run as `python -m unirl.x`, and a bare class name (`CamelCase`, or
  `CamelCase.attr`) that the repository defines.

Nothing is imported: every module is parsed with `ast`, so the check takes about a second and
is not fooled by import side effects. Deliberate exceptions are listed in ALLOWED below, each
with its reason.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DOCS = sorted(
    {
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "unirl").rglob("README.md"),
        *(ROOT / "worlds").rglob("README.md"),
        *(ROOT / "checkpoints").glob("*/TRAINING.md"),
        *(ROOT / "docs").rglob("*.md"),
    }
)

# Names the docs mention on purpose although the repository does not define them. Each says why.
ALLOWED: dict[str, str] = {
    # third-party names the docs explain although our code reaches them by another path
    # (third-party classes our code imports are recognised without a listing)
    "TransferQueueClient": "TransferQueue's client, made by its client factory",
    "TransferQueueController": "TransferQueue's controller actor, found by name",
    "NonTensorStack": "tensordict's container, what TransferQueue returns for non-tensor fields",
    "NodeManagerAddress": "a key of Ray's ray.nodes() records",
    "WanTransformerBlock": "diffusers' Wan block, which the Wan recipes name as a string (fsdp.block_classes)",
    "QwenImageTransformerBlock": "diffusers' Qwen-Image block, which its recipes name as a string (fsdp.block_classes)",
    "Flux2TransformerBlock": "diffusers' FLUX.2 double-stream block, which its recipes name as a string (fsdp.block_classes)",
    "Flux2SingleTransformerBlock": "diffusers' FLUX.2 single-stream block, named as a string like the double-stream one",
    "PixtralProcessor": "transformers' FLUX.2-dev processor, which needs torchvision: the FLUX.2 bundle loads its tokenizer alone",
    "HunyuanVideo15ImageToVideoPipeline": "diffusers' HunyuanVideo 1.5 I2V pipeline, in the note on what that family leaves",
}

SKIP_DIRS = {".git", ".venv", "node_modules", "outputs", "__pycache__", ".ruff_cache", ".pytest_cache"}


def _repo_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in SKIP_DIRS or rel.parts[0].endswith(".egg-info")):
            continue
        if any(p in SKIP_DIRS for p in rel.parts):
            continue
        if path.is_file():
            out.append(rel)
    return out


REPO_FILES = _repo_files()
REPO_PATHS = {p.as_posix() for p in REPO_FILES}
PY_FILES = [p for p in REPO_FILES if p.suffix == ".py"]


# --- markdown ------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    heading = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading)
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    heading = heading.strip().lower()
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


# --- static symbol resolution ----------------------------------------------------------------------


@functools.cache
def _module_file(module: str) -> Path | None:
    """'unirl.a.b' -> unirl/a/b.py or unirl/a/b/__init__.py, if there is one."""
    base = ROOT.joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _targets(node: ast.AST) -> list[str]:
    """Names bound by an assignment target."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _bindings(body: list[ast.stmt], module: str | None) -> dict[str, tuple]:
    """Names a module or class body binds -> how: ("def", node), ("import", module, name) or ("value",)."""
    out: dict[str, tuple] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = ("def", node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _targets(target):
                    out[name] = ("value",)
        elif isinstance(node, ast.AnnAssign):
            for name in _targets(node.target):
                out[name] = ("value",)
        elif isinstance(node, ast.ImportFrom) and module is not None:
            if node.level:
                pkg = module.split(".")[: -node.level] if module else []
                src = ".".join([*pkg, *([node.module] if node.module else [])])
            else:
                src = node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = ("import", src, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = ("import", alias.name, None)
        elif isinstance(node, (ast.If, ast.Try)):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner.extend(handler.body)
            out.update(_bindings(inner, module))
    return out


def _is_package(module: str) -> bool:
    path = _module_file(module)
    return path is not None and path.name == "__init__.py"


def _resolve_in_module(module: str, names: list[str], depth: int = 0) -> bool:
    """Whether `module.names[0].names[1]...` exists, reading source only."""
    if not names:
        return True
    if depth > 8:
        return False
    head, rest = names[0], names[1:]
    if _is_package(module) and _module_file(f"{module}.{head}") is not None:
        return _resolve_in_module(f"{module}.{head}", rest, depth + 1)
    path = _module_file(module)
    if path is None:
        return False
    binding = _bindings(_tree(path).body, module).get(head)
    if binding is None:
        return False
    if binding[0] == "import":
        src, name = binding[1], binding[2]
        if not src.startswith(("unirl", "worlds")):
            return True  # a third-party name re-exported; its attributes are not ours to check
        if name is None:
            return _resolve_in_module(src, rest, depth + 1)
        return _resolve_in_module(src, [name, *rest], depth + 1)
    if binding[0] == "def":
        return _resolve_in_def(module, binding[1], rest, depth)
    return not rest  # a module-level value: its attributes are not checked statically


def _resolve_in_def(module: str, node: ast.AST, names: list[str], depth: int) -> bool:
    """Whether a function or class has the attribute chain `names` (class bodies, `self.x =` in
    methods, and bases defined in the repository)."""
    if not names:
        return True
    if not isinstance(node, ast.ClassDef):
        return False
    head, rest = names[0], names[1:]
    body = _bindings(node.body, None)
    if head in body:
        kind = body[head]
        return _resolve_in_def(module, kind[1], rest, depth) if kind[0] == "def" else not rest
    for sub in ast.walk(node):  # instance attributes set in methods
        if isinstance(sub, (ast.Assign, ast.AnnAssign)):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and target.attr == head
                ):
                    return not rest
    for base in node.bases:  # inherited: follow bases named in this module or imported into it
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name and _resolve_in_module(module, [base_name, *names], depth + 1):
            return True
    return False


@functools.cache
def _defined_names() -> dict[str, list[tuple[str, ast.ClassDef | ast.FunctionDef]]]:
    """Every class and top-level function defined under unirl/, benchmarks/, scripts/, tests/ -> where."""
    out: dict[str, list] = {}
    for rel in PY_FILES:
        module = ".".join(rel.with_suffix("").parts)
        try:
            tree = _tree(ROOT / rel)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append((module, node))
    return out


@functools.cache
def _imported_names() -> set[str]:
    """Every name the repository's code imports from a third-party module (`from diffusers import X`)."""
    out = set()
    for rel in PY_FILES:
        for node in ast.walk(_tree(ROOT / rel)):
            if isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(("unirl", "worlds")):
                out.update(alias.name for alias in node.names)
    return out


def _resolve_bare(names: list[str]) -> bool:
    """`Class` or `Class.attr` against every class the repository defines; a builtin (`ValueError`)
    or a third-party class the code imports (`StableDiffusion3Pipeline`) is taken as it is."""
    if names[0] in dir(builtins) or names[0] in _imported_names():
        return True
    return any(_resolve_in_def(module, node, names[1:], 0) for module, node in _defined_names().get(names[0], []))


def _file_exists(ref: str, doc: Path) -> bool:
    """A `.py` file named in a doc: a path from the doc's folder or the root, a path suffix, or a bare name."""
    ref = ref.lstrip("./")
    if (doc.parent / ref).is_file() or (ROOT / ref).is_file():
        return True
    return any(p == ref or p.endswith("/" + ref) for p in REPO_PATHS)


# --- what the docs name ---------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./\"'-])((?:unirl|worlds)(?:\.\w+)+)")
# a committed file by path: `unirl/rollout/README.md`, `examples/diffusion/shapes_*.yaml` (globs allowed)
PATHREF = re.compile(r"(?<![\w/.<{-])((?:[\w.*-]+/)+[\w.*-]+\.(?:md|yaml|sh|toml|jinja))(?![\w/])")
PYFILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
CONFIG_NAME = re.compile(r"--config-name[= ](\w+/\w+)")
RECIPE_ARG = re.compile(r"--recipe[= ](\w+/\w+)")
BARE_CLASS = re.compile(r"^([A-Z][a-z0-9]+[A-Z][a-z]\w*)((?:\.\w+)*)(?:\(.*\))?$")
BRACE = re.compile(r"\{([\w,]+)\}")


def _expand(ref: str) -> list[str]:
    """`llm/arith_{dapo,gspo}` -> both names."""
    match = BRACE.search(ref)
    if not match:
        return [ref]
    return [x for alt in match.group(1).split(",") for x in _expand(ref[: match.start()] + alt + ref[match.end() :])]


def _problems(doc: Path) -> list[str]:
    text = doc.read_text()
    prose = _prose(text)
    where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    out: list[str] = []

    for match in LINK.finditer(prose):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z]+:", target):
            continue  # http(s):, mailto:
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            out.append(f"{where}: link ({target}) points at a file that does not exist")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
            out.append(f"{where}: link ({target}) names an anchor that {dest.name} has no heading for")

    for match in [*CONFIG_NAME.finditer(text), *RECIPE_ARG.finditer(text)]:
        for name in _expand(match.group(1)):
            if not (ROOT / "examples" / f"{name}.yaml").is_file():
                out.append(f"{where}: recipe `{name}` has no examples/{name}.yaml")

    for match in re.finditer(r"python -m ((?:unirl|worlds)(?:\.\w+)+)", text):
        module = match.group(1)
        if module not in ALLOWED and _module_file(module) is None:
            out.append(f"{where}: `python -m {module}`: no such module")

    spans = [m.group(2).strip() for m in CODE_SPAN.finditer(prose)]
    for span in spans:
        for ref in DOTTED.findall(span):
            for name in _expand(ref):
                if name in ALLOWED:
                    continue
                parts = name.split(".")
                if not _resolve_in_module(parts[0], parts[1:]):
                    out.append(f"{where}: `{name}` does not exist")
        for ref in PYFILE.findall(span):
            for name in _expand(ref):
                if name not in ALLOWED and not _file_exists(name, doc):
                    out.append(f"{where}: file `{name}` does not exist")
        for ref in PATHREF.findall(span):
            if not any(fnmatch.fnmatch(p, ref.lstrip("./")) for p in REPO_PATHS) and not _file_exists(ref, doc):
                out.append(f"{where}: file `{ref}` does not exist")
        bare = BARE_CLASS.match(span)
        if bare and bare.group(1) not in ALLOWED:
            names = [bare.group(1), *[n for n in bare.group(2).split(".") if n]]
            if not _resolve_bare(names):
                out.append(f"{where}: `{span}` names a class or attribute the repository does not define")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_is_true(doc: Path) -> None:
    problems = _problems(doc)
    assert not problems, "\n".join(problems)


def test_checker_catches_false_claims(tmp_path: Path) -> None:
    """The check is not vacuous: each kind of false claim in a doc is reported, true ones are not."""
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](../../README.md) is not checked here; [gone](missing.md) is.\n"
        "`unirl.types.segments.TokenSegment` `unirl.types.segments.TextSegment` "
        "`unirl.trainer.worker.RLWorker.build` `TokenSegment.response_ids` `TextSegment` "
        "`unirl/trainer/worker.py` `worker.py` `nowhere.py` `examples/llm/tiny_lm_grpo.yaml` "
        "`examples/llm/missing.yaml` `ValueError` `StableDiffusion3Pipeline`\n"
        "```bash\npython -m unirl.train_nothing --config-name=llm/tiny_lm_grpo\n"
        "python -m unirl.train_vlm --config-name=llm/no_such_recipe\n```\n"
    )
    problems = "\n".join(_problems(doc))
    for false in (
        "(missing.md)",
        "`unirl.types.segments.TextSegment`",
        "`unirl.trainer.worker.RLWorker.build`",
        "`TextSegment`",
        "`nowhere.py`",
        "`examples/llm/missing.yaml`",
        "unirl.train_nothing",
        "`llm/no_such_recipe`",
    ):
        assert false in problems, f"{false} was not reported:\n{problems}"
    for true in (
        "TokenSegment`",
        "`worker.py`",
        "tiny_lm_grpo",
        "ValueError",
        "StableDiffusion3Pipeline",
        "`unirl/trainer/worker.py`",
    ):
        assert f"{true} " not in problems and f"`{true}`" not in problems, problems


def test_allow_list_is_needed() -> None:
    """Every allow-listed name is still named by some doc: the list does not collect dead entries."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    unused = [name for name in ALLOWED if name not in text]
    assert not unused, f"ALLOWED entries no doc names any more (remove them): {unused}"


def capability_rows(text: str) -> list[list[str]]:
    """The cells of the top README's capability table (after its header and separator)."""
    lines = text.split("\n")
    start = lines.index("| area | what | CPU | GPU |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


CLAIM_FREE = ("not run", "-")
CELL_CHARS = 160


def capability_problems(text: str) -> list[str]:
    """Cells of the capability table that are not one short line, and CPU / GPU cells that claim
    something without linking the page of its evidence."""
    problems = []
    for row in capability_rows(text):
        what = row[1] or row[0]
        for column, cell in zip(("area", "what", "CPU", "GPU"), row, strict=True):
            if len(cell) > CELL_CHARS:
                problems.append(f"{what!r} {column}: {len(cell)} characters (at most {CELL_CHARS}; details go to docs/results/capabilities.md)")
            if column in ("CPU", "GPU") and cell not in CLAIM_FREE and "](" not in cell:
                problems.append(f"{what!r} {column}: {cell!r} claims something but links no evidence")
    return problems


def test_capability_table_is_one_line_a_cell_linking_its_evidence() -> None:
    """The top README's capability table reads at a glance: one short line a cell, and every CPU
    or GPU cell that claims something links the page with its evidence (`test_doc_is_true` checks
    that the link resolves); the details live in docs/results/capabilities.md."""
    text = (ROOT / "README.md").read_text()
    assert len(capability_rows(text)) >= 30
    assert capability_problems(text) == []
    bad = (
        "| area | what | CPU | GPU |\n|---|---|---|---|\n"
        "| models | tiny SD3 | runs | H200: runs ([devices.md](docs/results/devices.md)) |\n"
        f"| | x | {'y' * (CELL_CHARS + 1)} ([a](b.md)) | not run |\n"
    )
    found = capability_problems(bad)
    assert any("'tiny SD3' CPU: 'runs' claims something but links no evidence" in p for p in found)
    assert any("'x' CPU:" in p and "characters" in p for p in found) and len(found) == 2
