"""The shapes world: scene specs, prompts, a deterministic renderer and the train/eval split.

A scene is one to three flat-coloured geometric shapes on a light-gray
background. Everything here is pure numpy and deterministic given a seed or a
`numpy.random.Generator`.

Vocabulary (kept small so a tiny text-to-image model can learn it):
    colors     red, green, blue, yellow (`PALETTE`), background `BACKGROUND`
    shapes     circle, square, triangle (upright isosceles)
    counts     "a" (1), "two", "three"
    relations  "left of", "right of", "above", "below"

Categories and prompt grammar (the only sentences `scene_to_prompt` writes and
`parse_prompt` reads):
    single       "a red circle"
    two_objects  "a red circle and a blue square"     (objects differ in colour and shape)
    counting     "two red circles", "three blue squares"
    position     "a red circle left of a blue square" (objects differ in colour and shape)
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from unirl.data.data_source import ListDataSource
from unirl.types.rollout_req import PromptExample

BACKGROUND: tuple[int, int, int] = (230, 230, 230)
"""Background RGB."""

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 40),
}
"""Colour name -> RGB. Pairwise RGB distances are >= 150 and each is >= 190 from the background."""

COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
CATEGORIES: tuple[str, ...] = ("single", "two_objects", "counting", "position")
COUNT_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three"}
COUNTING_COUNTS: tuple[int, ...] = (2, 3)
"""Counts enumerated by `all_scenes` for the counting category (count 1 is the single category)."""

_PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles"}
_WORD_COUNTS: dict[str, int] = {w: n for n, w in COUNT_WORDS.items()}

# Geometry at the reference resolution of 32 px; `render` scales it with `size`.
_REF_SIZE = 32
_MIN_SIDE = 10
_MAX_SIDE = 14
_MAX_SIDE_COUNT3 = 12  # three objects of side 14 rarely fit with gaps at 32 px
_GAP = 2  # min empty pixels between object bounding boxes, so same-coloured objects never touch
_REL_MIN_AXIS = 10  # position scenes: centre offset along the relation axis >= this
_REL_MAX_CROSS = 4  # ... and across it <= this


@dataclass(frozen=True)
class ShapeSpec:
    """One coloured shape: `color` in `COLORS`, `shape` in `SHAPES`."""

    color: str
    shape: str

    def __post_init__(self) -> None:
        if self.color not in PALETTE:
            raise ValueError(f"unknown color {self.color!r}; known: {list(COLORS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; known: {list(SHAPES)}")

    @property
    def phrase(self) -> str:
        """'red circle'."""
        return f"{self.color} {self.shape}"


@dataclass
class SceneSpec:
    """What a prompt asks for.

    Attributes:
        category: one of `CATEGORIES`.
        objects: single -> [A]; counting -> [A] (drawn `count` times);
            two_objects -> [A, B]; position -> [A, B] meaning "A <relation> B".
        count: number of copies for counting (1..3), None otherwise.
        relation: one of `RELATIONS` for position, None otherwise.
    """

    category: str
    objects: list[ShapeSpec] = field(default_factory=list)
    count: int | None = None
    relation: str | None = None

    def __post_init__(self) -> None:
        n_obj = {"single": 1, "counting": 1, "two_objects": 2, "position": 2}
        if self.category not in n_obj:
            raise ValueError(f"unknown category {self.category!r}; known: {list(CATEGORIES)}")
        if len(self.objects) != n_obj[self.category]:
            raise ValueError(
                f"category {self.category!r} needs {n_obj[self.category]} object(s), got {len(self.objects)}"
            )
        if (self.category == "counting") != (self.count is not None):
            raise ValueError(
                f"count is set iff category is counting, got {self.category!r} count={self.count}"
            )
        if self.count is not None and self.count not in COUNT_WORDS:
            raise ValueError(f"count must be in {sorted(COUNT_WORDS)}, got {self.count}")
        if (self.category == "position") != (self.relation is not None):
            raise ValueError(
                f"relation is set iff category is position, got {self.category!r} relation={self.relation!r}"
            )
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}; known: {list(RELATIONS)}")
        if len(self.objects) == 2 and self.objects[0] == self.objects[1]:
            raise ValueError(f"the two objects of a {self.category} scene must differ, got {self.objects}")

    def rendered_objects(self) -> list[ShapeSpec]:
        """The objects drawn in the image (counting repeats its object `count` times)."""
        if self.category == "counting":
            assert self.count is not None
            return [self.objects[0]] * self.count
        return list(self.objects)


# ---------------------------------------------------------------- prompts


def scene_to_prompt(spec: SceneSpec) -> str:
    """The prompt of a scene (lower case, single spaces, no punctuation)."""
    if spec.category == "single":
        return f"a {spec.objects[0].phrase}"
    if spec.category == "counting":
        assert spec.count is not None
        obj = spec.objects[0]
        if spec.count == 1:
            return f"one {obj.phrase}"
        return f"{COUNT_WORDS[spec.count]} {obj.color} {_PLURALS[obj.shape]}"
    a, b = spec.objects
    if spec.category == "two_objects":
        return f"a {a.phrase} and a {b.phrase}"
    return f"a {a.phrase} {spec.relation} a {b.phrase}"


def _parse_object(words: list[str], prompt: str, plural: bool = False) -> ShapeSpec:
    shapes = {v: k for k, v in _PLURALS.items()} if plural else {s: s for s in SHAPES}
    if len(words) != 2 or words[0] not in PALETTE or words[1] not in shapes:
        raise ValueError(
            f"cannot parse prompt {prompt!r}: expected '<color> <shape>', got {' '.join(words)!r}"
        )
    return ShapeSpec(words[0], shapes[words[1]])


def parse_prompt(prompt: str) -> SceneSpec:
    """The `SceneSpec` of a prompt; exact inverse of `scene_to_prompt`.

    Case and surrounding/repeated whitespace are ignored. Raises ValueError
    naming the prompt when it is not in the grammar of this module.
    """
    words = prompt.strip().lower().split()
    try:
        if len(words) == 3 and words[0] == "a":
            return SceneSpec("single", [_parse_object(words[1:], prompt)])
        if len(words) == 3 and words[0] in _WORD_COUNTS:
            count = _WORD_COUNTS[words[0]]
            return SceneSpec("counting", [_parse_object(words[1:], prompt, plural=count > 1)], count=count)
        if len(words) == 7 and words[0] == "a" and words[3] == "and" and words[4] == "a":
            return SceneSpec(
                "two_objects", [_parse_object(words[1:3], prompt), _parse_object(words[5:], prompt)]
            )
        for rel in RELATIONS:
            rw = rel.split()
            k = len(rw)
            if len(words) == 6 + k and words[0] == "a" and words[3 : 3 + k] == rw and words[3 + k] == "a":
                a = _parse_object(words[1:3], prompt)
                b = _parse_object(words[4 + k :], prompt)
                return SceneSpec("position", [a, b], relation=rel)
    except ValueError as e:
        if repr(prompt) in str(e):
            raise
        raise ValueError(f"cannot parse prompt {prompt!r}: {e}") from e
    raise ValueError(
        f"cannot parse prompt {prompt!r}: not one of 'a <color> <shape>', '<two|three> <color> <shapes>', "
        f"'a <color> <shape> and a <color> <shape>', 'a <color> <shape> <relation> a <color> <shape>'"
    )


# ---------------------------------------------------------------- rendering


def shape_mask(shape: str, height: int, width: int | None = None) -> np.ndarray:
    """bool [height, width] mask of a shape filling a height x width box (pixel centres tested),
    read-only (one array per shape and size, computed once: rendering a dataset draws the same
    few thousand times).

    The renderer draws it in square boxes; the scorer fits it to a detection's bbox.
    """
    return _shape_mask(shape, height, height if width is None else width)


@functools.lru_cache(maxsize=4096)
def _shape_mask(shape: str, height: int, width: int) -> np.ndarray:
    mask = _draw_mask(shape, height, width)
    mask.flags.writeable = False
    return mask


def _draw_mask(shape: str, height: int, width: int) -> np.ndarray:
    y, x = np.meshgrid((np.arange(height) + 0.5) / height, (np.arange(width) + 0.5) / width, indexing="ij")
    if shape == "square":
        return np.ones((height, width), dtype=bool)
    if shape == "circle":
        return (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25
    if shape == "triangle":  # apex at top centre, base along the bottom row
        return np.abs(x - 0.5) <= 0.5 * y + 0.5 / width
    raise ValueError(f"unknown shape {shape!r}")


def _overlaps(box: tuple[int, int, int], boxes: list[tuple[int, int, int]], gap: int) -> bool:
    x, y, s = box
    for bx, by, bs in boxes:
        if x < bx + bs + gap and bx < x + s + gap and y < by + bs + gap and by < y + s + gap:
            return True
    return False


def _relation_ok(a: tuple[int, int, int], b: tuple[int, int, int], relation: str, scale: float) -> bool:
    """Centre of box a stands in `relation` to box b, clearly (see module constants)."""
    dx = (a[0] + a[2] / 2) - (b[0] + b[2] / 2)
    dy = (a[1] + a[2] / 2) - (b[1] + b[2] / 2)
    along, cross = {"left of": (-dx, dy), "right of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[
        relation
    ]
    return along >= _REL_MIN_AXIS * scale and abs(cross) <= _REL_MAX_CROSS * scale


def _place(spec: SceneSpec, rng: np.random.Generator, size: int) -> list[tuple[int, int, int]]:
    """(x, y, side) boxes for `spec.rendered_objects()`: inside the image, pairwise >= gap apart."""
    scale = size / _REF_SIZE
    n = len(spec.rendered_objects())
    gap = max(1, round(_GAP * scale))
    lo = max(3, round(_MIN_SIDE * scale))
    hi = max(lo, round((_MAX_SIDE_COUNT3 if n >= 3 else _MAX_SIDE) * scale))
    for _ in range(2000):
        boxes: list[tuple[int, int, int]] = []
        for _ in range(n):
            s = int(rng.integers(lo, hi + 1))
            box = (int(rng.integers(0, size - s + 1)), int(rng.integers(0, size - s + 1)), s)
            if _overlaps(box, boxes, gap):
                break
            boxes.append(box)
        if len(boxes) != n:
            continue
        if spec.relation is not None and not _relation_ok(boxes[0], boxes[1], spec.relation, scale):
            continue
        return boxes
    raise RuntimeError(f"could not place {n} objects for {scene_to_prompt(spec)!r} at size {size}")


def render(spec: SceneSpec, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """Draw a scene: uint8 [size, size, 3] RGB.

    Shapes have side / diameter 10-14 px at size 32 (10-12 px for three
    objects), scaled linearly with `size`; they lie fully inside the image,
    with >= 2 px (scaled) of background between bounding boxes. Position
    scenes put the centres >= 10 px apart along the relation axis and <= 4 px
    apart across it. Deterministic given the state of `rng`.
    """
    if size < 16:
        raise ValueError(f"render size must be >= 16, got {size}")
    return draw(spec.rendered_objects(), _place(spec, rng, size), size)


def draw(objects: list[ShapeSpec], boxes: list[tuple[int, int, int]], size: int) -> np.ndarray:
    """uint8 [size, size, 3]: each object drawn in its (x, y, side) box on the background, in order
    (`render` places the boxes; the editing world moves them)."""
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for obj, (x, y, s) in zip(objects, boxes, strict=True):
        region = img[y : y + s, x : x + s]
        region[shape_mask(obj.shape, s)] = PALETTE[obj.color]
    return img


# ---------------------------------------------------------------- scenes and split


def _objects() -> list[ShapeSpec]:
    return [ShapeSpec(c, s) for c in COLORS for s in SHAPES]


def all_scenes() -> list[SceneSpec]:
    """Every scene of the vocabulary, in a fixed order.

    single: 12 (colour x shape); two_objects: 36 unordered pairs of objects
    differing in both colour and shape, in canonical order (first by colour,
    then shape, index); counting: 12 objects x counts (2, 3) = 24; position:
    the 36 pairs x 4 relations = 144. Total 216.
    """
    objs = _objects()
    pairs = object_pairs()
    scenes = [SceneSpec("single", [o]) for o in objs]
    scenes += [SceneSpec("two_objects", [a, b]) for a, b in pairs]
    scenes += [SceneSpec("counting", [o], count=n) for o in objs for n in COUNTING_COUNTS]
    scenes += [SceneSpec("position", [a, b], relation=r) for a, b in pairs for r in RELATIONS]
    return scenes


HELD_OUT_PAIRS = 9
"""How many of the 36 object pairs `held_out_pairs` keeps out of training."""
HELD_OUT_COUNTS = 6
"""How many (object, count) combinations `held_out_counts` keeps out of training."""
_MIN_TRAIN_PAIRS_PER_OBJECT = 3  # of the 6 pairs each object is in


def object_pairs() -> list[tuple[ShapeSpec, ShapeSpec]]:
    """The 36 unordered pairs of objects differing in both colour and shape, in canonical order."""
    objs = _objects()
    return [(a, b) for a, b in itertools.combinations(objs, 2) if a.color != b.color and a.shape != b.shape]


def held_out_pairs(seed: int = 0) -> list[tuple[ShapeSpec, ShapeSpec]]:
    """The `HELD_OUT_PAIRS` object pairs whose two_objects and position scenes are eval-only.

    Drawn with `numpy.random.default_rng(seed)` (a permutation of `object_pairs()`,
    redrawn until every object still appears in >= 3 training pairs), returned
    in canonical order.
    """
    pairs = object_pairs()
    rng = np.random.default_rng(seed)
    while True:
        pick = sorted(rng.permutation(len(pairs))[:HELD_OUT_PAIRS].tolist())
        held = [pairs[i] for i in pick]
        train_uses = {o: 0 for o in _objects()}
        for pair in pairs:
            if pair not in held:
                for o in pair:
                    train_uses[o] += 1
        if min(train_uses.values()) >= _MIN_TRAIN_PAIRS_PER_OBJECT:
            return held


def held_out_counts(seed: int = 0) -> list[tuple[ShapeSpec, int]]:
    """The `HELD_OUT_COUNTS` (object, count) combinations that are eval-only.

    `HELD_OUT_COUNTS` distinct objects drawn with `numpy.random.default_rng(seed + 1)`,
    each with one count of `COUNTING_COUNTS`; the object's other count stays in
    training. Returned in `_objects()` order.
    """
    objs = _objects()
    rng = np.random.default_rng(seed + 1)
    idx = sorted(rng.permutation(len(objs))[:HELD_OUT_COUNTS].tolist())
    return [(objs[i], int(rng.choice(COUNTING_COUNTS))) for i in idx]


def _is_eval(
    spec: SceneSpec, pairs: list[tuple[ShapeSpec, ShapeSpec]], counts: list[tuple[ShapeSpec, int]]
) -> bool:
    if spec.category == "counting":
        return (spec.objects[0], spec.count) in counts
    if spec.category in ("two_objects", "position"):
        a, b = spec.objects
        return (a, b) in pairs or (b, a) in pairs
    return False


def is_eval_scene(spec: SceneSpec, seed: int = 0) -> bool:
    """The split rule: a two_objects or position scene of a held-out pair (either order), or a
    counting scene of a held-out (object, count); singles are always training scenes."""
    return _is_eval(spec, held_out_pairs(seed), held_out_counts(seed))


def split_scenes(seed: int = 0) -> tuple[list[SceneSpec], list[SceneSpec]]:
    """(train, eval) partition of `all_scenes()`, both in `all_scenes` order.

    Combinations, not objects, are held out (as GenEval-style RL training sets
    do): eval holds the two_objects and position scenes of `held_out_pairs(seed)`
    and the counting scenes of `held_out_counts(seed)`; every object is still
    trained alone, in >= 3 pairs and counted. 165 train, 51 eval (9
    two_objects, 6 counting, 36 position).
    """
    pairs, counts = held_out_pairs(seed), held_out_counts(seed)
    train, evals = [], []
    for s in all_scenes():
        (evals if _is_eval(s, pairs, counts) else train).append(s)
    return train, evals


def prompt_id(spec: SceneSpec) -> str:
    """Stable id of a scene: 'shapes/<category>/<prompt with _ for spaces>'."""
    return f"shapes/{spec.category}/{scene_to_prompt(spec).replace(' ', '_')}"


class ShapesDataset:
    """The prompts of one split, plus rendered image/prompt batches for supervised pretraining.

    Args:
        split: "train" or "eval" (see `split_scenes`).
        seed: the split seed.

    Attributes:
        scenes: the split's `SceneSpec`s in `all_scenes` order.
        examples: one `PromptExample(prompt, prompt_id, {"category": ...})` per scene.
    """

    def __init__(self, split: str = "train", seed: int = 0) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"ShapesDataset split must be 'train' or 'eval', got {split!r}")
        train, evals = split_scenes(seed)
        self.split = split
        self.seed = seed
        self.scenes: list[SceneSpec] = train if split == "train" else evals
        self.examples: list[PromptExample] = [
            PromptExample(
                prompt=scene_to_prompt(s), prompt_id=prompt_id(s), metadata={"category": s.category}
            )
            for s in self.scenes
        ]
        self._by_category: dict[str, list[SceneSpec]] = {}
        for s in self.scenes:
            self._by_category.setdefault(s.category, []).append(s)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def sample_batch(self, n: int, rng: np.random.Generator, size: int = 32) -> tuple[np.ndarray, list[str]]:
        """n random scenes of this split, rendered with random placements.

        A category is drawn uniformly among those present, then a scene of it
        uniformly (so the many position scenes do not crowd out the rest).

        Returns:
            images: uint8 [n, size, size, 3]; prompts: n strings.
        """
        cats = sorted(self._by_category, key=CATEGORIES.index)
        images = np.empty((n, size, size, 3), dtype=np.uint8)
        prompts: list[str] = []
        for i in range(n):
            group = self._by_category[cats[int(rng.integers(len(cats)))]]
            spec = group[int(rng.integers(len(group)))]
            images[i] = render(spec, rng, size)
            prompts.append(scene_to_prompt(spec))
        return images, prompts


class ShapesDemonstrations(ListDataSource):
    """The split's scenes as supervised rows (recipe: `_target_: worlds.shapes.ShapesDemonstrations`):
    each prompt with a rendering of its scene under metadata "image" ([size, size, 3] uint8), the
    demonstrations a flow-matching SFT track learns from (`unirl.algorithms.sft.FlowSFT` with
    `rollout: unirl.rollout.demonstrations.DemonstrationEngine`, `target_key: image`).

    One placement per scene, drawn once from `seed` (the retired single-process loop drew a new
    placement every time and a category before a scene; here every scene is a row of a shuffled
    epoch). Epochs, shuffling and resume are `ListDataSource`'s.
    """

    def __init__(self, split: str = "train", seed: int = 0, size: int = 32, shuffle: bool = True) -> None:
        dataset = ShapesDataset(split, seed)
        rng = np.random.default_rng(seed)
        rows = [
            PromptExample(e.prompt, e.prompt_id, {**e.metadata, "image": render(spec, rng, size)})
            for e, spec in zip(dataset.examples, dataset.scenes, strict=True)
        ]
        super().__init__(
            rows, shuffle=shuffle, seed=seed, source=f"<shapes demonstrations split={split} seed={seed} size={size}>"
        )
