"""Training data for the learned shapes reward: renders, perturbed renders and near-miss prompts,
labelled by the weight-free scorer.

Everything here is numpy and deterministic given a generator. Images are uint8 [H, W, 3].
`synth_batch` draws training scenes (never an eval scene: prompts stay in the training split),
renders them, perturbs some (noise, blur, ghosting of another render, colour bleed, erosion or
dilation of one object, a dropped or an extra object, a shift) and pairs each image with its own
prompt, a near miss (one attribute changed) or another training prompt. `detection_labels` gives
the detector's training targets (the scorer's per-pixel objects and their centres), `targets`
turns a batch of them into the 16x16 cell classes and centre heat the network predicts, and
`label` scores (image, prompt) pairs with `GenEvalMini` into the `reward_model.HEADS` verdicts
(and where each applies), against which the model's agreement is measured.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from worlds.shapes.reward_model import BACKGROUND_CLASS, CLASSES, GRID, HEADS, class_index
from worlds.shapes.scorer import GenEvalMini, classify_pixels, connected_components, detect_with_labels
from worlds.shapes.world import (
    BACKGROUND,
    COLORS,
    PALETTE,
    RELATIONS,
    SHAPES,
    SceneSpec,
    ShapesDataset,
    ShapeSpec,
    parse_prompt,
    scene_to_prompt,
)

_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def blur(img: np.ndarray) -> np.ndarray:
    """One 3x3 binomial blur (edges replicated)."""
    x = np.pad(img.astype(np.float32), ((1, 1), (1, 1), (0, 0)), mode="edge")
    k = np.array([1.0, 2.0, 1.0]) / 4
    x = k[0] * x[:-2] + k[1] * x[1:-1] + k[2] * x[2:]
    x = k[0] * x[:, :-2] + k[1] * x[:, 1:-1] + k[2] * x[:, 2:]
    return np.clip(np.round(x), 0, 255).astype(np.uint8)


def _components(img: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    cls = classify_pixels(img)
    lab = connected_components(cls, len(COLORS))
    return cls, lab, [int(c) for c in np.unique(lab[lab >= 0])]


def perturb(img: np.ndarray, rng: np.random.Generator, other: np.ndarray) -> np.ndarray:
    """One to three random perturbations of a render (`other`: another render for ghosting and
    pasting). Each keeps the image uint8 [H, W, 3]."""
    out = img.copy()
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["noise", "blur", "ghost", "bleed", "erode", "dilate", "drop", "paste", "shift"])
        if kind == "noise":
            out = np.clip(out + rng.normal(0, rng.uniform(5, 40), out.shape), 0, 255).astype(np.uint8)
        elif kind == "blur":
            out = blur(out)
        elif kind == "ghost":
            a = rng.uniform(0.15, 0.6)
            out = np.round((1 - a) * out + a * other).astype(np.uint8)
        else:
            cls, lab, comps = _components(out)
            if not comps and kind != "shift":
                continue
            comp = int(rng.choice(comps)) if comps else -1
            mask = lab == comp
            if kind == "bleed":  # an object's colour blends toward another palette colour
                to = np.array(PALETTE[str(rng.choice(COLORS))], dtype=np.float32)
                a = rng.uniform(0.2, 0.7)
                out[mask] = np.round((1 - a) * out[mask] + a * to).astype(np.uint8)
            elif kind in ("erode", "dilate"):
                pad = np.pad(mask, 1)
                nb = [
                    pad[1 + dy : pad.shape[0] - 1 + dy, 1 + dx : pad.shape[1] - 1 + dx]
                    for dy in (-1, 0, 1)
                    for dx in (-1, 0, 1)
                ]
                if kind == "erode":
                    edge = mask & ~np.logical_and.reduce(nb)
                    keep = rng.random(mask.shape) < rng.uniform(0.0, 0.6)
                    out[edge & ~keep] = BACKGROUND
                else:
                    ring = np.logical_or.reduce(nb) & ~mask & (cls == len(COLORS))
                    grow = rng.random(mask.shape) < rng.uniform(0.3, 1.0)
                    out[ring & grow] = out[mask][0]
            elif kind == "drop":
                out[mask] = BACKGROUND
            elif kind == "paste":  # an object of `other` pasted at a random offset (may overlap)
                _, olab, ocomps = _components(other)
                if ocomps:
                    om = olab == int(rng.choice(ocomps))
                    shifted = np.roll(
                        om, (int(rng.integers(-12, 13)), int(rng.integers(-12, 13))), axis=(0, 1)
                    )
                    colour = other[om][0]
                    out[shifted] = colour
            elif kind == "shift":
                dy, dx = (int(v) for v in rng.integers(-4, 5, 2))
                moved = np.full_like(out, BACKGROUND)
                h, w = out.shape[:2]
                moved[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = out[
                    max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
                ]
                out = moved
    return out


def near_miss(spec: SceneSpec, rng: np.random.Generator, train: set[str]) -> SceneSpec | None:
    """A training scene one attribute away from `spec` (an object's colour or shape, the count, the
    relation, or the object order), or None when no such change stays in `train` (prompts)."""
    for _ in range(20):
        objs = list(spec.objects)
        count, relation = spec.count, spec.relation
        kind = rng.choice(["color", "shape", "count", "relation", "swap"])
        j = int(rng.integers(len(objs)))
        if kind == "color":
            objs[j] = ShapeSpec(str(rng.choice([c for c in COLORS if c != objs[j].color])), objs[j].shape)
        elif kind == "shape":
            objs[j] = ShapeSpec(objs[j].color, str(rng.choice([s for s in SHAPES if s != objs[j].shape])))
        elif kind == "count" and count is not None:
            count = 5 - count  # 2 <-> 3
        elif kind == "relation" and relation is not None:
            relation = (
                _OPPOSITE[relation]
                if rng.random() < 0.5
                else str(rng.choice([r for r in RELATIONS if r != relation]))
            )
        elif kind == "swap" and len(objs) == 2:
            objs = objs[::-1]
        else:
            continue
        try:
            cand = SceneSpec(spec.category, objs, count=count, relation=relation)
        except ValueError:
            continue
        prompt = scene_to_prompt(cand)
        if prompt in train and prompt != scene_to_prompt(spec):
            return cand
    return None


def pair_prompts(
    prompts: Sequence[str],
    rng: np.random.Generator,
    train: list[str],
    p_near: float = 0.3,
    p_random: float = 0.1,
) -> list[str]:
    """Each prompt kept, or (with probability `p_near`) a near miss of it, or (`p_random`) a
    random training prompt: the prompt an image is labelled against."""
    train_set = set(train)
    out = []
    for p in prompts:
        u = rng.random()
        if u < p_near:
            cand = near_miss(parse_prompt(p), rng, train_set)
            out.append(scene_to_prompt(cand) if cand is not None else p)
        elif u < p_near + p_random:
            out.append(str(rng.choice(train)))
        else:
            out.append(p)
    return out


def synth_batch(
    n: int, rng: np.random.Generator, split_seed: int = 0, p_perturb: float = 0.7
) -> tuple[np.ndarray, list[str]]:
    """n (image, prompt) pairs from training scenes: renders, perturbed with probability
    `p_perturb`, paired by `pair_prompts`. Returns (uint8 [n, 32, 32, 3], prompts)."""
    ds = ShapesDataset("train", split_seed)
    images, prompts = ds.sample_batch(n, rng)
    others, _ = ds.sample_batch(n, rng)
    images = np.stack(
        [
            perturb(img, rng, other) if rng.random() < p_perturb else img
            for img, other in zip(images, others, strict=True)
        ]
    )
    return images, pair_prompts(prompts, rng, [e.prompt for e in ds.examples])


def label(images: np.ndarray, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(targets, mask), both float32 [n, len(HEADS)]: `GenEvalMini`'s verdicts of each (image,
    prompt) and 1 where the verdict applies (count: counting prompts; position: position prompts)."""
    results = GenEvalMini().score_all(images, prompts)
    targets = np.zeros((len(results), len(HEADS)), dtype=np.float32)
    mask = np.zeros_like(targets)
    for i, r in enumerate(results):
        for j, head in enumerate(HEADS):
            if head in r:
                targets[i, j] = float(r[head])
                mask[i, j] = 1.0
    return targets, mask


MAX_OBJECTS = 8
HEAT_SIGMA = 1.0  # grid cells (2 px)


def detection_labels(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scorer's detections of uint8 images [n, 32, 32, 3] as the detector's targets:
    (pixel classes int8 [n, 32, 32]: the `CLASSES` index of the detection a pixel belongs to,
    else `BACKGROUND_CLASS`; objects float32 [n, MAX_OBJECTS, 3]: (class, cx, cy) of each
    detection, largest first, class -1 past the last)."""
    classes = np.full(images.shape[:3], BACKGROUND_CLASS, dtype=np.int8)
    objects = np.zeros((len(images), MAX_OBJECTS, 3), dtype=np.float32)
    objects[:, :, 0] = -1
    for n, img in enumerate(images):
        dets, index = detect_with_labels(img)
        for i, d in enumerate(dets[:MAX_OBJECTS]):
            k = class_index(d.color, d.shape)
            classes[n][index == i] = k
            objects[n, i] = (k, d.cx, d.cy)
    return classes, objects


def targets(classes: torch.Tensor, objects: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch targets of the detector from `detection_labels` (as tensors): (cell class
    distributions [B, 13, 16, 16], the pixel one-hots averaged over each 2x2 cell; centre heat
    [B, 12, 16, 16], a normalised Gaussian of `HEAT_SIGMA` cells at each detection's centre, so
    a class's map sums to its number of detections)."""
    b = classes.shape[0]
    onehot = F.one_hot(classes.long(), BACKGROUND_CLASS + 1).permute(0, 3, 1, 2).float()
    cells = F.avg_pool2d(onehot, 2)
    heat = torch.zeros(b * len(CLASSES), GRID, GRID)
    rows, slots = torch.nonzero(objects[:, :, 0] >= 0, as_tuple=True)
    if len(rows):
        obj = objects[rows, slots]
        pos = torch.arange(GRID, dtype=torch.float32) + 0.5
        gx = torch.exp(-((pos[None, :] - obj[:, 1:2] / 2) ** 2) / (2 * HEAT_SIGMA**2))
        gy = torch.exp(-((pos[None, :] - obj[:, 2:3] / 2) ** 2) / (2 * HEAT_SIGMA**2))
        g = gy[:, :, None] * gx[:, None, :]
        g = g / g.sum(dim=(1, 2), keepdim=True)
        heat.index_add_(0, rows * len(CLASSES) + obj[:, 0].long(), g)
    return cells, heat.view(b, len(CLASSES), GRID, GRID)
