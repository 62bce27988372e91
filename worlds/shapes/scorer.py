"""GenEval in miniature: a weight-free detector and scene checker for the shapes world.

`detect` segments an image by palette colour and classifies each connected
component's shape from two bounding-box statistics; `score_scene` checks the
detections against a `SceneSpec`; `GenEvalMini` turns that into a reward
component and an evaluation summary. Pure numpy (torch only at the reward
boundary); no weights, no scipy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unirl.types.reward import RewardRequest
from worlds.shapes.world import BACKGROUND, CATEGORIES, PALETTE, SHAPES, SceneSpec, parse_prompt, shape_mask

_COLORS: tuple[str, ...] = tuple(PALETTE)
_REFS = np.array([*PALETTE.values(), BACKGROUND], dtype=np.float32)  # [C+1, 3], background last
_BG = len(_COLORS)

# Shape features (row-filled, trimmed bbox) of renders at 10-14 px: fill = area / bbox area is
# 1.0 for squares, 0.78-0.81 for circles, 0.60-0.71 for triangles; top/bottom = area in the
# upper half of the bbox / area in the lower half is ~1.0 for squares and circles and
# 0.43-0.49 for upright triangles. Under two 3x3 binomial blurs plus Gaussian noise (std 15)
# the ranges widen to squares fill >= 0.87, circles fill <= 0.89 and top/bottom >= 0.74,
# triangles top/bottom <= 0.68; the thresholds sit in those gaps.
_TRIANGLE_TOP_BOTTOM = 0.72
_SQUARE_FILL = 0.88
_MAX_MATCHED_DETECTIONS = 8  # the optimal assignment considers the largest 8 components
_RELATION_FULL_MARGIN = 6.0  # px of along - |cross| for full graded relation credit (renders: >= 6)


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        color: palette colour name.
        shape: "circle", "square" or "triangle".
        cx, cy: centre of mass in pixels (x to the right, y down; pixel centres at i + 0.5).
        area: pixel count of the component.
        bbox: (x0, y0, x1, y1), x1/y1 exclusive.
        fit: IoU of the trimmed component with each shape of `SHAPES` (in that order) drawn in
            its trimmed bbox; () when unknown (hand-made detections), and graded credit then
            falls back to the shape label.
    """

    color: str
    shape: str
    cx: float
    cy: float
    area: int
    bbox: tuple[int, int, int, int]
    fit: tuple[float, ...] = ()


def _to_hwc_uint8(image: np.ndarray | torch.Tensor) -> np.ndarray:
    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] or [3, H, W] image, got {arr.dtype} {list(arr.shape)}")
    if arr.shape[-1] != 3 and arr.shape[0] == 3:
        arr = arr.transpose(1, 2, 0)
    if arr.shape[-1] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] or [3, H, W] image, got {list(arr.shape)}")
    return arr


def classify_pixels(image: np.ndarray, max_distance: float = 100.0) -> np.ndarray:
    """int [H, W] map: index into `PALETTE` order, or len(PALETTE) for background / unknown.

    Each pixel takes the nearest of the palette colours and the background by
    RGB distance; a palette pixel farther than `max_distance` from its colour
    (an edge blend or noise) counts as background.
    """
    img = _to_hwc_uint8(image).astype(np.float32)
    dist = np.linalg.norm(img[:, :, None, :] - _REFS[None, None], axis=-1)  # [H, W, C+1]
    cls = dist.argmin(axis=-1)
    too_far = np.take_along_axis(dist, cls[..., None], axis=-1)[..., 0] > max_distance
    cls[too_far & (cls != _BG)] = _BG
    return cls


def connected_components(cls: np.ndarray, background: int) -> np.ndarray:
    """int [H, W] component labels (8-connectivity, same class), -1 on background.

    Labels are the smallest flat pixel index of the component (min-label
    propagation until stable; at most a few dozen numpy sweeps at 32x32).
    """
    h, w = cls.shape
    fg = cls != background
    big = h * w
    lab = np.where(fg, np.arange(big).reshape(h, w), big)
    pad_cls = np.pad(cls, 1, constant_values=background)
    same = [
        (pad_cls[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] == cls) & fg
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
        if dy or dx
    ]
    shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
    while True:
        pad = np.pad(lab, 1, constant_values=big)
        new = lab.copy()
        for (dy, dx), ok in zip(shifts, same, strict=True):
            nb = pad[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]
            new = np.where(ok, np.minimum(new, nb), new)
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(fg, lab, -1)


def classify_shape(mask: np.ndarray) -> str:
    """'square', 'circle' or 'triangle' for a bool [h, w] mask cropped to its bbox.

    Rows are filled between their leftmost and rightmost pixel first, so holes
    from noise do not lower the fill ratio. Triangle if the upper half of the
    bbox holds < 0.72x the pixels of the lower half; else square if the fill
    ratio (area / bbox area) is >= 0.88; else circle.
    """
    h, w = mask.shape
    rows = mask.any(axis=1)
    span = np.zeros(h, dtype=np.float64)
    idx = np.arange(w)
    for r in np.nonzero(rows)[0]:
        xs = idx[mask[r]]
        span[r] = xs[-1] - xs[0] + 1
    top, bottom = span[: h // 2].sum(), span[(h + 1) // 2 :].sum()
    if bottom > 0 and top / bottom < _TRIANGLE_TOP_BOTTOM:
        return "triangle"
    return "square" if span.sum() / (h * w) >= _SQUARE_FILL else "circle"


def shape_fit(mask: np.ndarray) -> tuple[float, ...]:
    """IoU of a bool [h, w] bbox-cropped mask with each shape of `SHAPES` drawn in the same box.

    Clean renders fit their own shape with IoU 0.85-1.0 (triangles lose their apex row to
    `_trim`) and the others with <= 0.81.
    """
    h, w = mask.shape
    fits = []
    for shape in SHAPES:
        t = shape_mask(shape, h, w)
        fits.append(float((mask & t).sum() / max(int((mask | t).sum()), 1)))
    return tuple(fits)


def detect(
    image: np.ndarray | torch.Tensor, min_area: int | None = None, max_distance: float = 100.0
) -> list[Detection]:
    """Objects in an image, largest first.

    Args:
        image: uint8 [H, W, 3] (or [3, H, W]) RGB.
        min_area: components smaller than this many pixels are noise and
            dropped; default 12 at 32x32, scaled with H * W.
        max_distance: see `classify_pixels`.

    A component's bbox is trimmed of edge rows/columns holding < 20% of its
    widest row/column (stray pixels touching the shape), then its shape is
    classified by `classify_shape`.
    """
    return detect_with_labels(image, min_area, max_distance)[0]


def detect_with_labels(
    image: np.ndarray | torch.Tensor, min_area: int | None = None, max_distance: float = 100.0
) -> tuple[list[Detection], np.ndarray]:
    """`detect`'s detections (largest first) and an int [H, W] map of the detection each pixel
    belongs to (its index in that list; -1 for background, edge blends and dropped components):
    the per-pixel targets of the learned reward (`reward_model`)."""
    img = _to_hwc_uint8(image)
    h, w = img.shape[:2]
    if min_area is None:
        min_area = max(4, round(12 * h * w / 1024))
    cls = classify_pixels(img, max_distance)
    lab = connected_components(cls, _BG)
    ids, counts = np.unique(lab[lab >= 0], return_counts=True)
    found: list[tuple[Detection, int]] = []
    for comp, area in zip(ids.tolist(), counts.tolist(), strict=True):
        if area < min_area:
            continue
        ys, xs = np.nonzero(lab == comp)
        y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
        mask = lab[y0:y1, x0:x1] == comp
        mask = _trim(mask)
        det = Detection(
            color=_COLORS[int(cls.flat[comp])],
            shape=classify_shape(mask),
            cx=float(xs.mean() + 0.5),
            cy=float(ys.mean() + 0.5),
            area=int(area),
            bbox=(int(x0), int(y0), int(x1), int(y1)),
            fit=shape_fit(mask),
        )
        found.append((det, comp))
    found.sort(key=lambda dc: -dc[0].area)
    index = np.full((h, w), -1, dtype=np.int64)
    for i, (_, comp) in enumerate(found):
        index[lab == comp] = i
    return [d for d, _ in found], index


def _trim(mask: np.ndarray, frac: float = 0.2) -> np.ndarray:
    """Drop edge rows/columns of a bool mask whose count is < frac x the max (stray attached pixels).

    At most one row/column per side, so a triangle apex (1-2 px rows) loses at most one row.
    """
    for axis in (0, 1):
        counts = mask.sum(axis=1 - axis)
        if len(counts) < 4:
            continue
        thr = frac * counts.max()
        lo = 1 if counts[0] < thr else 0
        hi = len(counts) - 1 if counts[-1] < thr else len(counts)
        mask = mask[lo:hi] if axis == 0 else mask[:, lo:hi]
    return mask


# ---------------------------------------------------------------- checking


def relation_holds(a: Detection, b: Detection, relation: str) -> bool:
    """Centre of `a` is `relation` of the centre of `b`: displaced the right way, and more along
    the relation axis than across it ("left of": b.cx - a.cx > |b.cy - a.cy|)."""
    return relation_margin(a, b, relation) > 0


def relation_margin(a: Detection, b: Detection, relation: str) -> float:
    """Pixels by which `a` is `relation` of `b` beyond the diagonal: along - |cross|
    (> 0 with along > 0 iff `relation_holds`)."""
    dx, dy = a.cx - b.cx, a.cy - b.cy
    along, cross = {"left of": (-dx, dy), "right of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[
        relation
    ]
    return along - abs(cross)


def shape_credit(want: str, det: Detection) -> float:
    """Graded shape credit in [0, 1]: half for the right label, half for the fit margin.

    The margin is the IoU with the wanted shape's template minus the best IoU with another
    shape's; it maps linearly from -0.2 (0) to +0.2 (1), so credit moves with every pixel
    that makes the component more or less like the wanted shape (clean renders: margin
    >= 0.2). Without `det.fit` the credit is the label's 0/1.
    """
    right = float(det.shape == want)
    if not det.fit:
        return right
    i = SHAPES.index(want)
    margin = det.fit[i] - max(f for j, f in enumerate(det.fit) if j != i)
    return 0.5 * right + 0.5 * float(np.clip(0.5 + margin / 0.4, 0.0, 1.0))


def _match_score(want: Any, det: Detection | None, graded: bool = False) -> float:
    """0.5 [right colour] + 0.5 shape: the label's 0/1, or `shape_credit` when graded."""
    if det is None:
        return 0.0
    shape = shape_credit(want.shape, det) if graded else float(det.shape == want.shape)
    return 0.5 * (det.color == want.color) + 0.5 * shape


def _assign(wanted: list, dets: list[Detection]) -> list[Detection | None]:
    """Injective assignment of detections to wanted objects maximising the sum of match scores
    (ties: more exact matches, then larger detections, which come first in `dets`)."""
    cands: list[Detection | None] = [*dets[:_MAX_MATCHED_DETECTIONS], *([None] * len(wanted))]
    best: tuple[float, int, int] | None = None
    best_pick: list[Detection | None] = [None] * len(wanted)
    for perm in itertools.permutations(range(len(cands)), len(wanted)):
        pick = [cands[i] for i in perm]
        scores = [_match_score(w, d) for w, d in zip(wanted, pick, strict=True)]
        key = (sum(scores), sum(s == 1.0 for s in scores), -sum(perm))
        if best is None or key > best:
            best, best_pick = key, pick
    return best_pick


def score_scene(spec: SceneSpec, detections: list[Detection]) -> dict[str, Any]:
    """Check detections against a scene.

    The wanted objects are `spec.rendered_objects()` (k of them: 1, 2 or the
    count); detections are assigned to them one-to-one, maximising the sum of
    per-object match scores (0.5 right colour + 0.5 right shape).

    Returns:
        strict: 1.0 iff every wanted object has an exact match, there are no
            other detections, and (position) the relation holds between the
            matched pair; else 0.0.
        dense: in [0, 1], mean of the terms: mean match score over the k
            objects; count closeness max(0, 1 - |n - k| / k) with n the number
            of detections (penalises missing and extra objects); for position
            also 1.0 if the relation holds between the two assigned
            detections (0.0 if either is missing).
        graded: dense with continuous partial credit, for training rewards: each
            object's shape half is `shape_credit` (label plus template-fit margin)
            and the relation term is 0.5 [holds] + 0.5 clip(margin / 6 px, 0, 1)
            (`relation_margin`; clean renders have >= 6 px). Without a
            detection's `fit` its shape half is the label's 0/1. >= 0.98 on clean
            renders (small triangles fit with a margin a little under 0.2).
        color, shape: bool, every wanted object's assigned detection has the
            right colour / shape.
        count (counting only): bool, exactly k detections of the wanted colour and shape.
        position (position only): bool, both objects exactly matched and the relation holds.
        n_detections, n_extra: ints.
    """
    wanted = spec.rendered_objects()
    k = len(wanted)
    pick = _assign(wanted, detections)
    scores = [_match_score(w, d) for w, d in zip(wanted, pick, strict=True)]
    n = len(detections)
    n_extra = n - sum(d is not None for d in pick)
    exact = all(s == 1.0 for s in scores)
    count_term = max(0.0, 1.0 - abs(n - k) / k)
    terms = [float(np.mean(scores)), count_term]
    graded = [
        float(np.mean([_match_score(w, d, graded=True) for w, d in zip(wanted, pick, strict=True)])),
        count_term,
    ]
    out: dict[str, Any] = {
        "color": all(d is not None and d.color == w.color for w, d in zip(wanted, pick, strict=True)),
        "shape": all(d is not None and d.shape == w.shape for w, d in zip(wanted, pick, strict=True)),
        "n_detections": n,
        "n_extra": n_extra,
    }
    strict = exact and n_extra == 0
    if spec.category == "counting":
        target = wanted[0]
        out["count"] = sum(d.color == target.color and d.shape == target.shape for d in detections) == k
    if spec.category == "position":
        assert spec.relation is not None
        a, b = pick
        rel = a is not None and b is not None and relation_holds(a, b, spec.relation)
        terms.append(float(rel))
        margin = relation_margin(a, b, spec.relation) if a is not None and b is not None else 0.0
        graded.append(0.5 * rel + 0.5 * float(np.clip(margin / _RELATION_FULL_MARGIN, 0.0, 1.0)))
        out["position"] = bool(exact and rel)
        strict = strict and rel
    out["strict"] = float(strict)
    out["dense"] = float(np.mean(terms))
    out["graded"] = float(np.mean(graded))
    return out


# ---------------------------------------------------------------- reward and evaluation


def _images_hwc(images: np.ndarray | torch.Tensor) -> np.ndarray:
    arr = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if arr.dtype != np.uint8 or arr.ndim != 4 or 3 not in (arr.shape[1], arr.shape[-1]):
        raise ValueError(
            f"images must be uint8 [B, 3, H, W] or [B, H, W, 3], got {arr.dtype} {list(arr.shape)}"
        )
    return arr if arr.shape[-1] == 3 else arr.transpose(0, 2, 3, 1)


_MODES = ("dense", "graded", "strict")


class GenEvalMini:
    """Scorer: GenEval in miniature for the shapes world, weight-free.

    Args:
        mode: "dense" (partial credit in [0, 1]), "graded" (dense with continuous shape and
            relation credit, the training reward) or "strict" (0/1), see `score_scene`.
        min_area: see `detect` (None: 12 px at 32x32, scaled).
        max_distance: see `classify_pixels`.

        intent_key: None: each image is judged against its prompt. A metadata key: against the
            scene of `metadata[intent_key]` instead (a canonical prompt: the user's intent when the
            prompts are a prompt enhancer's rewrites, e.g. "canonical" of `ShapesPEDataset`).

    `__call__(req)` parses each prompt (or intent) with `parse_prompt` (one outside
    the grammar, or a missing intent, raises ValueError naming it and its sample id) and returns [B]
    fp32 scores in [0, 1], in request order.
    """

    def __init__(
        self,
        mode: str = "dense",
        min_area: int | None = None,
        max_distance: float = 100.0,
        intent_key: str | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"GenEvalMini mode must be one of {_MODES}, got {mode!r}")
        if min_area is not None and min_area < 1:
            raise ValueError(f"GenEvalMini min_area must be >= 1, got {min_area}")
        if not max_distance > 0:
            raise ValueError(f"GenEvalMini max_distance must be > 0, got {max_distance}")
        if intent_key is not None and (not isinstance(intent_key, str) or not intent_key):
            raise ValueError(f"GenEvalMini intent_key must be a non-empty string or null, got {intent_key!r}")
        self.mode = mode
        self.min_area = min_area
        self.max_distance = max_distance
        self.intent_key = intent_key

    def score_all(
        self, images: np.ndarray | torch.Tensor, prompts: Sequence[str], intents: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """`score_scene` results for each image ([B, 3, H, W] or [B, H, W, 3] uint8) and prompt, or,
        given `intents` (canonical prompts, one per image), against the intents' scenes."""
        arr = _images_hwc(images)
        if len(prompts) != arr.shape[0]:
            raise ValueError(f"got {arr.shape[0]} images but {len(prompts)} prompts")
        if intents is not None and len(intents) != arr.shape[0]:
            raise ValueError(f"got {arr.shape[0]} images but {len(intents)} intents")
        wanted = prompts if intents is None else intents
        specs = [parse_prompt(p) for p in wanted]
        return [
            score_scene(spec, detect(img, self.min_area, self.max_distance))
            for spec, img in zip(specs, arr, strict=True)
        ]

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        images = req.require_images("GenEvalMini")
        intents = None if self.intent_key is None else self.intents(req)
        for sid, p in zip(req.sample_ids, req.prompts if intents is None else intents, strict=True):
            try:
                parse_prompt(p)
            except ValueError as e:
                raise ValueError(f"sample {sid!r}: {e}") from e
        results = self.score_all(images, req.prompts, intents)
        return torch.tensor([r[self.mode] for r in results], dtype=torch.float32)

    def intents(self, req: RewardRequest) -> list[str]:
        """`metadata[intent_key]` of each sample; a sample without it raises ValueError naming it."""
        metadata = req.metadata or [{} for _ in req.sample_ids]
        out = []
        for sid, meta in zip(req.sample_ids, metadata, strict=True):
            if self.intent_key not in meta:
                raise ValueError(
                    f"GenEvalMini: sample {sid!r} has no metadata key {self.intent_key!r} (intent_key; keys: "
                    f"{sorted(meta)}); give the prompts their canonical scene or set intent_key: null"
                )
            out.append(str(meta[self.intent_key]))
        return out

    def evaluate(
        self, images: np.ndarray | torch.Tensor, prompts: Sequence[str], intents: Sequence[str] | None = None
    ) -> dict[str, float]:
        """Accuracy summary (see module function `evaluate`), against `intents` when given."""
        wanted = prompts if intents is None else intents
        return summarize(self.score_all(images, prompts, intents), [parse_prompt(p).category for p in wanted])


def summarize(results: Sequence[dict[str, Any]], categories: Sequence[str]) -> dict[str, float]:
    """Means of `score_scene` results.

    Returns:
        accuracy_strict: GenEval's overall score, the mean over the categories
            present of their strict accuracy (so the many position prompts do
            not stand for the whole).
        accuracy_strict_samples: strict accuracy over all samples.
        dense, graded: mean dense and graded scores.
        accuracy/<category>: strict accuracy of each category present.
        color, shape (all prompts), count (counting prompts), position
        (position prompts): per-aspect accuracies.
    """
    if not results:
        raise ValueError("summarize needs at least one result")
    if len(results) != len(categories):
        raise ValueError(f"got {len(results)} results but {len(categories)} categories")
    per_cat = {}
    for cat in CATEGORIES:
        vals = [r["strict"] for r, c in zip(results, categories, strict=True) if c == cat]
        if vals:
            per_cat[f"accuracy/{cat}"] = float(np.mean(vals))
    out = {
        "accuracy_strict": float(np.mean(list(per_cat.values()))),
        "accuracy_strict_samples": float(np.mean([r["strict"] for r in results])),
        "dense": float(np.mean([r["dense"] for r in results])),
        "graded": float(np.mean([r["graded"] for r in results])),
        **per_cat,
    }
    for aspect in ("color", "shape", "count", "position"):
        vals = [float(r[aspect]) for r in results if aspect in r]
        if vals:
            out[aspect] = float(np.mean(vals))
    return out


def evaluate(images: np.ndarray | torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
    """Score images ([B, 3, H, W] or [B, H, W, 3] uint8) against prompts with default settings;
    the keys of `summarize`."""
    return GenEvalMini().evaluate(images, prompts)
