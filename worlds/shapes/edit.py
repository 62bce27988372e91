"""The shapes editing world: a source scene, an instruction that changes one attribute of one
object, the scene it asks for, and a weight-free scorer of an edit (EditReward in miniature).

Instructions (`Edit.instruction` writes them, `parse_instruction` is its exact inverse):

| kind | instruction | target scene |
|---|---|---|
| colour | `make the red circle blue` | the object recoloured, in its box |
| shape | `turn the red circle into a square` | the object redrawn as the new shape, in its box |
| move | `move the red circle to the left` | the object's box moved to that side (`MARGIN` px from the edge), the other coordinate kept |

A source holds the named object alone, or with one other object differing in colour and shape
(so the name picks exactly one object). Source and target are drawn from the same boxes
(`world.draw`): every pixel the instruction does not touch is the same in both.

Split: `held_out_edits(seed)` draws 6 instructions of each kind; their rows are evaluation-only
(training never sees that object given that edit), the other 90 instructions train.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from unirl.data import ListDataSource
from unirl.types import PromptExample
from unirl.types.reward import RewardRequest
from worlds.shapes.scorer import Detection, _images_hwc, detect, shape_credit
from worlds.shapes.world import COLORS, SHAPES, SceneSpec, ShapeSpec, _overlaps, _place, draw

EDIT_KINDS: tuple[str, ...] = ("colour", "shape", "move")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "top": (0, -1), "bottom": (0, 1)}
"""A move's side -> its unit step (x to the right, y down)."""

MARGIN = 2
"""A moved object's box ends this many pixels from the edge it was moved to (at 32 px, scaled)."""
MIN_MOVE = 8
"""A move shifts its object's box by at least this many pixels (at 32 px, scaled); a source where
it could not is redrawn."""
KEEP_TOL = 1.5
"""Pixels (at 32 px, scaled) a kept object's centre may drift with full credit; credit falls
linearly to 0 at 4x this."""
HELD_OUT_PER_KIND = 6
MIN_SIZE = 24
"""The smallest side the world renders at: at 16 px, 101 of the 756 rows' sources are misread by
`detect` (a 5 px circle taken for a square); from 24 px every row's target scores strict 1."""


@dataclass(frozen=True)
class Edit:
    """One instruction: change `obj`'s `kind` to `value` (a colour, a shape, or a side of
    `DIRECTIONS`)."""

    kind: str
    obj: ShapeSpec
    value: str

    def __post_init__(self) -> None:
        allowed = {"colour": COLORS, "shape": SHAPES, "move": tuple(DIRECTIONS)}
        if self.kind not in allowed:
            raise ValueError(f"unknown edit kind {self.kind!r}; known: {list(EDIT_KINDS)}")
        if self.value not in allowed[self.kind]:
            raise ValueError(
                f"a {self.kind} edit takes one of {list(allowed[self.kind])}, got {self.value!r}"
            )
        if self.value == {"colour": self.obj.color, "shape": self.obj.shape}.get(self.kind):
            raise ValueError(f"the edit {self.kind}={self.value!r} would not change the {self.obj.phrase}")

    @property
    def instruction(self) -> str:
        if self.kind == "colour":
            return f"make the {self.obj.phrase} {self.value}"
        if self.kind == "shape":
            return f"turn the {self.obj.phrase} into a {self.value}"
        return f"move the {self.obj.phrase} to the {self.value}"

    @property
    def result(self) -> ShapeSpec:
        """The edited object's colour and shape."""
        if self.kind == "colour":
            return ShapeSpec(self.value, self.obj.shape)
        if self.kind == "shape":
            return ShapeSpec(self.obj.color, self.value)
        return self.obj


def parse_instruction(text: str) -> Edit:
    """The `Edit` an instruction states (the exact inverse of `Edit.instruction`); a text outside
    the grammar raises ValueError naming it."""
    words = text.split()
    try:
        if len(words) == 5 and words[:2] == ["make", "the"]:
            return Edit("colour", ShapeSpec(words[2], words[3]), words[4])
        if len(words) == 7 and words[:2] == ["turn", "the"] and words[4:6] == ["into", "a"]:
            return Edit("shape", ShapeSpec(words[2], words[3]), words[6])
        if len(words) == 7 and words[:2] == ["move", "the"] and words[4:6] == ["to", "the"]:
            return Edit("move", ShapeSpec(words[2], words[3]), words[6])
    except ValueError as e:
        raise ValueError(f"instruction {text!r}: {e}") from e
    raise ValueError(
        f"instruction {text!r} is outside the editing grammar ('make the red circle blue', "
        "'turn the red circle into a square', 'move the red circle to the left')"
    )


def all_edits() -> list[Edit]:
    """The 108 instructions: each of the 12 objects recoloured 3 ways, reshaped 2 ways, moved 4 ways."""
    out = []
    for obj in (ShapeSpec(c, s) for c in COLORS for s in SHAPES):
        out += [Edit("colour", obj, c) for c in COLORS if c != obj.color]
        out += [Edit("shape", obj, s) for s in SHAPES if s != obj.shape]
        out += [Edit("move", obj, d) for d in DIRECTIONS]
    return out


def held_out_edits(seed: int = 0) -> list[Edit]:
    """`HELD_OUT_PER_KIND` instructions of each kind, drawn with `default_rng(seed)`: evaluation only."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in EDIT_KINDS:
        pool = [e for e in all_edits() if e.kind == kind]
        out += [pool[i] for i in sorted(rng.choice(len(pool), HELD_OUT_PER_KIND, replace=False))]
    return out


def companions(obj: ShapeSpec) -> list[ShapeSpec]:
    """The objects a source may hold beside `obj`: those differing in both colour and shape."""
    return [ShapeSpec(c, s) for c in COLORS for s in SHAPES if c != obj.color and s != obj.shape]


@dataclass
class EditRow:
    """One edit drawn: the source's objects and boxes (the edited object first), the target's."""

    edit: Edit
    objects: list[ShapeSpec]
    boxes: list[tuple[int, int, int]]
    target_boxes: list[tuple[int, int, int]]
    size: int

    @property
    def source(self) -> np.ndarray:
        return draw(self.objects, self.boxes, self.size)

    @property
    def target(self) -> np.ndarray:
        return draw([self.edit.result, *self.objects[1:]], self.target_boxes, self.size)


def moved_box(box: tuple[int, int, int], side: str, size: int) -> tuple[int, int, int]:
    """`box` (x, y, side length) moved to `side` of a `size` image, `MARGIN` (scaled) from its edge."""
    x, y, s = box
    m = max(1, round(MARGIN * size / 32))
    return {
        "left": (m, y, s),
        "right": (size - s - m, y, s),
        "top": (x, m, s),
        "bottom": (x, size - s - m, s),
    }[side]


def draw_row(edit: Edit, other: ShapeSpec | None, rng: np.random.Generator, size: int = 32) -> EditRow:
    """Places the edited object (and `other`) at random as `world.render` does, redrawing until the
    edit is possible: a move shifts the box by >= `MIN_MOVE` px (scaled) without coming within the
    renderer's gap of the other object."""
    objects = [edit.obj] if other is None else [edit.obj, other]
    spec = SceneSpec("single", objects) if other is None else SceneSpec("two_objects", objects)
    scale = size / 32
    for _ in range(1000):
        boxes = _place(spec, rng, size)
        if edit.kind != "move":
            return EditRow(edit, objects, boxes, list(boxes), size)
        new = moved_box(boxes[0], edit.value, size)
        if abs(new[0] - boxes[0][0]) + abs(new[1] - boxes[0][1]) < MIN_MOVE * scale:
            continue
        if _overlaps(new, boxes[1:], max(1, round(2 * scale))):
            continue
        return EditRow(edit, objects, boxes, [new, *boxes[1:]], size)
    raise RuntimeError(f"could not place a source for {edit.instruction!r} at size {size}")


def edit_rows(
    split: str = "train", seed: int = 0, placements: int = 1, size: int = 32
) -> list[PromptExample]:
    """The split's rows: every instruction of the split with its object alone and beside each of
    its `companions` (7 sources), `placements` random placements each, drawn from `seed`. A row's
    metadata: "images" [source uint8 [size, size, 3]] (an edit family's condition), "target" (the
    image the instruction asks for), "kind". The images are rendered once per process and
    arguments, and read-only; each call returns its own rows and metadata dicts."""
    return [
        PromptExample(row.prompt, row.prompt_id, {**row.metadata, "images": list(row.metadata["images"])})
        for row in _rendered_rows(split, seed, placements, size)
    ]


@functools.lru_cache(maxsize=16)
def _rendered_rows(split: str, seed: int, placements: int, size: int) -> tuple[PromptExample, ...]:
    if split not in ("train", "eval"):
        raise ValueError(f"the editing world's split must be 'train' or 'eval', got {split!r}")
    if placements < 1:
        raise ValueError(f"placements must be >= 1, got {placements}")
    if size < MIN_SIZE:
        raise ValueError(
            f"the editing world renders at size >= {MIN_SIZE} px, got {size}: below it the scorer cannot tell a "
            "small circle from a square, so a row's own source would not hold its instruction"
        )
    held = set(held_out_edits(seed))
    edits = [e for e in all_edits() if (e in held) == (split == "eval")]
    rng = np.random.default_rng(seed)
    rows = []
    for edit in edits:
        for other in [None, *companions(edit.obj)]:
            for k in range(placements):
                row = draw_row(edit, other, rng, size)
                source, target = row.source, row.target
                source.flags.writeable = target.flags.writeable = False
                with_ = "alone" if other is None else other.phrase.replace(" ", "_")
                rows.append(
                    PromptExample(
                        prompt=edit.instruction,
                        prompt_id=f"shapes_edit/{edit.instruction.replace(' ', '_')}/{with_}/{k}",
                        metadata={"images": [source], "target": target, "kind": edit.kind},
                    )
                )
    return tuple(rows)


class ShapesEditDataset(ListDataSource):
    """The editing world's rows as a data source (`edit_rows`; recipes: `_target_:
    worlds.shapes.ShapesEditDataset`): RL prompts (an edit family reads the source under
    "images"), evaluation examples (`.examples`), and the demonstrations of a flow-matching SFT
    track (`rollout.target_key: target`). Epochs, shuffling and resume are `ListDataSource`'s.

    `rows`: a fixed pool of that many of the split's rows (`pool_rows`: drawn once from `seed`,
    in split order), visited epoch after epoch, as DDPO trains on a fixed prompt set; null: the
    whole split."""

    def __init__(
        self,
        split: str = "train",
        seed: int = 0,
        placements: int = 1,
        size: int = 32,
        shuffle: bool = True,
        rows: int | None = None,
    ) -> None:
        examples = edit_rows(split, seed, placements, size)
        super().__init__(
            examples if rows is None else pool_rows(examples, rows, seed),
            shuffle=shuffle,
            seed=seed,
            source=f"<shapes edits split={split} seed={seed} placements={placements} size={size} rows={rows}>",
        )


def pool_rows(examples: list[PromptExample], rows: int, seed: int) -> list[PromptExample]:
    """`rows` of `examples` drawn without replacement from `seed`, in their order (ValueError naming
    `data_source.rows` when it is not in [1, len(examples)])."""
    if not 1 <= rows <= len(examples):
        raise ValueError(
            f"data_source.rows={rows} must be in [1, {len(examples)}] (the split's rows), or null for all"
        )
    keep = sorted(np.random.default_rng(seed).choice(len(examples), size=rows, replace=False).tolist())
    return [examples[i] for i in keep]


# ---------------------------------------------------------------- scoring


def _closeness(dist: float, tol: float) -> float:
    """1 within `tol` pixels, falling linearly to 0 at 4 `tol`."""
    return float(np.clip(1.0 - (dist - tol) / (3.0 * tol), 0.0, 1.0))


def _centre(det: Detection) -> tuple[float, float]:
    """The centre of a detection's bbox (a reshaped object keeps its box, not its centre of mass)."""
    x0, y0, x1, y1 = det.bbox
    return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass
class _Wanted:
    spec: ShapeSpec  # colour and shape after the edit
    cx: float  # the source's bbox centre
    cy: float
    kind: str | None = None  # the edit's kind, for the edited object; None for a kept one
    move: tuple[int, int] | None = None  # the edited object's unit step, for a move
    needed: float = 0.0  # pixels the move asks for


def _credit(
    want: _Wanted, det: Detection | None, tol: float, graded: bool
) -> tuple[float | None, list[float], bool]:
    """(change, kept, exact) of a detection for a wanted object.

    change: for the edited object, the credit of the asked attribute: the new colour (0/1), the new
    shape (0/1, or `shape_credit` when `graded`), or the move's reach (the displacement along the
    asked side over the asked distance, clipped to [0, 1], times the closeness across it); None for
    a kept object. kept: the credits of every attribute that should not change: colour (0/1), shape,
    and a kept bbox centre's closeness (1 within `tol` px, 0 beyond 4 `tol`). exact: the colour and shape
    are the wanted ones and the place is right (a kept centre within 2 `tol`; a move at least half
    way along, at most 2 `tol` across)."""
    if det is None:
        return (0.0 if want.kind else None), [0.0] * (2 if want.kind else 3), False
    colour = float(det.color == want.spec.color)
    shape = shape_credit(want.spec.shape, det) if graded else float(det.shape == want.spec.shape)
    dx, dy = _centre(det)[0] - want.cx, _centre(det)[1] - want.cy
    if want.move is None:
        dist = float(np.hypot(dx, dy))
        place, place_ok = _closeness(dist, tol), dist <= 2 * tol
    else:
        along = dx * want.move[0] + dy * want.move[1]
        cross = abs(dx * want.move[1] + dy * want.move[0])
        place = float(np.clip(along / want.needed, 0.0, 1.0)) * _closeness(cross, tol)
        place_ok = along >= 0.5 * want.needed and cross <= 2 * tol
    exact = det.color == want.spec.color and det.shape == want.spec.shape and place_ok
    parts = {"colour": colour, "shape": shape, "move": place}
    if want.kind is None:
        return None, list(parts.values()), exact
    return parts.pop(want.kind), list(parts.values()), exact


def score_edit(
    source: np.ndarray, result: np.ndarray, edit: Edit, min_area: int | None = None
) -> dict[str, Any]:
    """How well `result` carries out `edit` on `source` (uint8 [H, W, 3] each).

    The source's objects are detected; the wanted scene is them with the edit applied (the edited
    object's new colour or shape at its centre, or its centre moved to the asked side by the
    displacement `moved_box` gives). The result's detections are assigned one-to-one to the wanted
    objects, maximising the summed credit (`_credit`). Returns:
      - `change`: the credit of the asked change; `kept`: the mean credit of everything that should
        stay (the edited object's other attributes, every other object's colour, shape and place);
        `count`: max(0, 1 - |n - k| / k) with n the result's detections, k the wanted objects;
      - `dense` = 0.5 change + 0.25 kept + 0.25 count (shape labels 0/1), `graded` the same with the
        shape credit graded (the training reward): 1 for the target, 0.5 for the source returned
        unchanged, 0 for a blank image;
      - `strict`: 1 iff every wanted object is matched exactly and nothing else is there.
    A source without exactly one object of the named colour and shape raises ValueError.
    """
    size = source.shape[0]
    tol = KEEP_TOL * size / 32
    found = detect(source, min_area)
    named = [d for d in found if d.color == edit.obj.color and d.shape == edit.obj.shape]
    if len(named) != 1:
        raise ValueError(
            f"the source holds {len(named)} {edit.obj.phrase}(s) (detected: "
            f"{[d.color + ' ' + d.shape for d in found]}); {edit.instruction!r} names exactly one"
        )
    src = named[0]
    wanted = [_Wanted(edit.result, *_centre(src), kind=edit.kind)]
    if edit.kind == "move":
        x0, y0, x1, y1 = src.bbox
        new = moved_box((x0, y0, x1 - x0), edit.value, size)
        needed = abs(new[0] - x0) + abs(new[1] - y0)
        wanted[0] = replace(wanted[0], move=DIRECTIONS[edit.value], needed=float(max(needed, 1)))
    wanted += [_Wanted(ShapeSpec(d.color, d.shape), *_centre(d)) for d in found if d is not src]
    dets = detect(result, min_area)
    count = max(0.0, 1.0 - abs(len(dets) - len(wanted)) / len(wanted))
    results: dict[str, Any] = {}
    for graded in (False, True):
        cands: list[Detection | None] = [*dets[:8], *([None] * len(wanted))]
        best = None
        for perm in itertools.permutations(range(len(cands)), len(wanted)):
            scored = [_credit(w, cands[i], tol, graded) for w, i in zip(wanted, perm, strict=True)]
            change = scored[0][0]
            kept = float(np.mean([k for _, ks, _ in scored for k in ks]))
            total = 0.5 * change + 0.25 * kept + 0.25 * count
            key = (total, -sum(perm))
            if best is None or key > best[0]:
                best = (key, change, kept, all(ok for _, _, ok in scored))
        (total, _), change, kept, exact = best
        results["graded" if graded else "dense"] = total
        if not graded:
            results.update(
                change=change, kept=kept, count=count, strict=float(exact and len(dets) == len(wanted))
            )
    return results


class ShapesEditScore:
    """Scorer: `score_edit` of each image against its row's source (`metadata[key][0]`) and its
    instruction (the prompt). Weight-free.

    Args:
        mode: "graded" (the training reward), "dense" or "strict" (see `score_edit`).
        key: the metadata key holding a row's source image (an edit family's condition key).
        min_area: see `detect`.

    `__call__(req) -> [B] fp32` in [0, 1]; `evaluate(images, prompts, metadata)` (the run's
    evaluation passes its examples' metadata: `reads_metadata`) -> `accuracy_strict` (the mean of
    each kind's strict accuracy), `strict/<kind>`, and the means of dense, change, kept and count.
    A prompt outside the grammar, or a sample without its source, raises ValueError naming it.
    """

    reads_metadata: ClassVar[bool] = True

    def __init__(self, mode: str = "graded", key: str = "images", min_area: int | None = None) -> None:
        if mode not in ("graded", "dense", "strict"):
            raise ValueError(
                f"ShapesEditScore mode must be one of ['graded', 'dense', 'strict'], got {mode!r}"
            )
        if min_area is not None and min_area < 1:
            raise ValueError(f"ShapesEditScore min_area must be >= 1, got {min_area}")
        self.mode = mode
        self.key = key
        self.min_area = min_area

    def score_all(
        self,
        images: np.ndarray | torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict[str, Any]],
        sample_ids: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """`score_edit` of every image ([B, 3, H, W] or [B, H, W, 3] uint8) against its row."""
        from unirl.models.images import load_image

        arr = _images_hwc(images)
        ids = list(sample_ids) if sample_ids else [str(i) for i in range(len(arr))]
        if not len(prompts) == len(metadata) == len(arr):
            raise ValueError(
                f"got {len(arr)} images, {len(prompts)} prompts and {len(metadata)} metadata dicts"
            )
        out = []
        for sid, img, prompt, meta in zip(ids, arr, prompts, metadata, strict=True):
            entries = meta.get(self.key)
            if not isinstance(entries, list | tuple) or not entries:
                raise ValueError(
                    f"sample {sid!r}: ShapesEditScore needs the row's source image in metadata {self.key!r}[0], "
                    f"got {entries!r}"
                )
            source = np.asarray(load_image(entries[0], sid, 0))
            if source.shape != img.shape:
                raise ValueError(
                    f"sample {sid!r}: the result is {img.shape} but its source is {source.shape}"
                )
            try:
                edit = parse_instruction(prompt)
                out.append({**score_edit(source, img, edit, self.min_area), "kind": edit.kind})
            except ValueError as e:
                raise ValueError(f"sample {sid!r}: {e}") from e
        return out

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8)."""
        images = req.require_images("ShapesEditScore")
        metadata = req.metadata or [{} for _ in req.sample_ids]
        results = self.score_all(images, req.prompts, metadata, req.sample_ids)
        return torch.tensor([r[self.mode] for r in results], dtype=torch.float32)

    def evaluate(
        self, images: np.ndarray | torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> dict[str, float]:
        results = self.score_all(images, prompts, metadata)
        out: dict[str, float] = {}
        kinds = [k for k in EDIT_KINDS if any(r["kind"] == k for r in results)]
        for kind in kinds:
            out[f"strict/{kind}"] = float(np.mean([r["strict"] for r in results if r["kind"] == kind]))
        out["accuracy_strict"] = float(np.mean([out[f"strict/{k}"] for k in kinds]))
        for name in ("strict", "dense", "graded", "change", "kept", "count"):
            out[name] = float(np.mean([r[name] for r in results]))
        return out
