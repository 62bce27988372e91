"""A learned, differentiable shapes reward: a small detector trained to reproduce `GenEvalMini`'s
detections, and a differentiable version of its scene check on top.

`SceneNet` reads a 32x32 RGB image in [0, 1] and predicts, on a 16x16 grid, the class of every
cell (background or one of the 12 colour x shape objects, `CLASSES`) and, per object class, a
centre heat map whose sum over the grid is the number of objects of that class (each detection
of the scorer is a unit of mass around its centre). It is trained on images labelled by
`scorer.detect_with_labels` (`python -m worlds.shapes.train_reward_model`), never on prompts, so it
knows objects, not prompts: a held-out combination is scored like any other.

The score of an image for a prompt (`scene_score`) is differentiable in the image:

    count term     exp(-sum_k (n_k - w_k)^2 / (2 tol^2))  n_k predicted objects of class k,
                   w_k the prompt's (a wanted object missing, a wrong colour or shape, an
                   extra object, a wrong count: each costs)
    relation term  sigmoid(margin / scale) for position prompts, margin = along - |cross|
                   between the two wanted classes' predicted centres (`scorer.relation_margin`)
    score          count term x relation term, in [0, 1]

`predicted_detections` rounds the counts into `Detection`s at the predicted centres, so the
scorer's own `score_scene` gives the model's verdicts (strict, colour, shape, count, position),
which is how its agreement with `GenEvalMini` is measured.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from unirl.types.reward import RewardRequest
from worlds.shapes.scorer import Detection, score_scene
from worlds.shapes.world import COLORS, SHAPES, SceneSpec, parse_prompt

CLASSES: tuple[tuple[str, str], ...] = tuple((c, s) for c in COLORS for s in SHAPES)
"""The object classes, colour-major: index = COLORS.index(colour) * len(SHAPES) + SHAPES.index(shape)."""
BACKGROUND_CLASS = len(CLASSES)
GRID = 16
"""Cells per side of the prediction grid (2x2 pixels of a 32x32 image per cell)."""
HEAT_MAX = 0.5
HEADS: tuple[str, ...] = ("strict", "color", "shape", "count", "position")
"""The verdicts compared with the scorer's (`score_scene`'s flags)."""
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def class_index(color: str, shape: str) -> int:
    return COLORS.index(color) * len(SHAPES) + SHAPES.index(shape)


def wanted_counts(spec: SceneSpec) -> torch.Tensor:
    """[len(CLASSES)] fp32: how many objects of each class the prompt asks for."""
    w = torch.zeros(len(CLASSES))
    for obj in spec.rendered_objects():
        w[class_index(obj.color, obj.shape)] += 1
    return w


@dataclass
class SceneNetConfig:
    """Widths of `SceneNet`: the full-resolution conv, the grid convs and their dilations."""

    stem: int = 16
    width: int = 32
    dilations: tuple[int, ...] = (1, 2, 4)
    size: int = 32

    def __post_init__(self) -> None:
        self.dilations = tuple(self.dilations)
        if min(self.stem, self.width) < 1 or not self.dilations or self.size != 2 * GRID:
            raise ValueError(f"SceneNetConfig needs widths >= 1, dilations, size {2 * GRID}: {self}")


class SceneNet(torch.nn.Module):
    """[B, 3, 32, 32] images in [0, 1] -> (class logits [B, 13, 16, 16], heat [B, 12, 16, 16]).

    A 3x3 conv at full resolution, a stride-2 3x3 conv to the 16x16 grid, dilated 3x3 convs
    (receptive field about the whole image), then 1x1 heads: class logits per cell (the 12
    `CLASSES` and background) and per-class centre heat `HEAT_MAX * sigmoid(.)`.
    """

    def __init__(self, cfg: SceneNetConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or SceneNetConfig()
        self.stem = torch.nn.Conv2d(3, cfg.stem, 3, padding=1)
        self.down = torch.nn.Conv2d(cfg.stem, cfg.width, 3, stride=2, padding=1)
        self.body = torch.nn.ModuleList(
            [torch.nn.Conv2d(cfg.width, cfg.width, 3, padding=d, dilation=d) for d in cfg.dilations]
        )
        self.head = torch.nn.Conv2d(cfg.width, len(CLASSES) + 1 + len(CLASSES), 1)
        with torch.no_grad():  # start the heat near 0 (counts ~0.1), not at half of HEAT_MAX in every cell
            self.head.bias[BACKGROUND_CLASS + 1 :] = -8.0

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(images.shape[1:]) != (3, self.cfg.size, self.cfg.size):
            raise ValueError(
                f"SceneNet needs [B, 3, {self.cfg.size}, {self.cfg.size}] images, got {list(images.shape)}"
            )
        h = F.relu(self.down(F.relu(self.stem(images * 2 - 1))))
        for conv in self.body:
            h = F.relu(h + conv(h))
        out = self.head(h)
        logits, heat = out[:, : BACKGROUND_CLASS + 1], out[:, BACKGROUND_CLASS + 1 :]
        return logits, HEAT_MAX * torch.sigmoid(heat)


def centres(heat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [B, K], cx [B, K], cy [B, K]) of heat maps [B, K, G, G]: mass, and its centre in
    image pixels (x right, y down, pixel centres at i + 0.5, as `Detection`)."""
    g = heat.shape[-1]
    scale = 2 * GRID / g
    pos = (torch.arange(g, device=heat.device, dtype=heat.dtype) + 0.5) * scale
    counts = heat.sum(dim=(2, 3))
    denom = counts + 1e-6
    cx = (heat.sum(dim=2) * pos).sum(dim=2) / denom
    cy = (heat.sum(dim=3) * pos).sum(dim=2) / denom
    return counts, cx, cy


def scene_score(
    heat: torch.Tensor, specs: Sequence[SceneSpec], count_tolerance: float = 0.5, relation_scale: float = 2.0
) -> torch.Tensor:
    """[B] differentiable scores in [0, 1] of heat maps [B, 12, G, G] for scenes (module docstring)."""
    counts, cx, cy = centres(heat)
    wanted = torch.stack([wanted_counts(s) for s in specs]).to(heat.device, heat.dtype)
    score = torch.exp(-((counts - wanted) ** 2).sum(dim=1) / (2 * count_tolerance**2))
    rel = []
    for b, spec in enumerate(specs):
        if spec.relation is None:
            rel.append(score.new_ones(()))
            continue
        i, j = (class_index(o.color, o.shape) for o in spec.objects)
        dx, dy = cx[b, i] - cx[b, j], cy[b, i] - cy[b, j]
        along, cross = {"left of": (-dx, dy), "right of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[
            spec.relation
        ]
        rel.append(torch.sigmoid((along - cross.abs()) / relation_scale))
    return score * torch.stack(rel)


def predicted_detections(heat: torch.Tensor) -> list[list[Detection]]:
    """Per image, round(count) `Detection`s of each class at its predicted centre (no area, box
    or fit): the model's detections, for `score_scene`."""
    counts, cx, cy = (t.detach().cpu() for t in centres(heat))
    out = []
    for b in range(heat.shape[0]):
        dets = []
        for k, (color, shape) in enumerate(CLASSES):
            n = int(torch.round(counts[b, k]).clamp(min=0))
            x, y = float(cx[b, k]), float(cy[b, k])
            dets += [Detection(color, shape, x, y, 1, (0, 0, 0, 0)) for _ in range(n)]
        out.append(dets)
    return out


def save_scene_net(net: SceneNet, path: str, extra: dict[str, Any] | None = None) -> None:
    """Write `model.safetensors` (fp32) and `config.json` (the widths, the classes, `extra`) under `path`."""
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.detach().cpu().float().contiguous() for k, v in net.state_dict().items()},
        os.path.join(path, WEIGHTS),
    )
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(
            {"net": asdict(net.cfg), "classes": [list(c) for c in CLASSES], **(extra or {})}, f, indent=2
        )


def load_scene_net(path: str) -> SceneNet:
    """The `SceneNet` saved under `path` by `save_scene_net` (eval mode, fp32)."""
    cfg_path, weights = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
        raise ValueError(
            f"ShapesRewardModel path {path!r} holds no {CONFIG} and {WEIGHTS}: train one with "
            "`python -m worlds.shapes.train_reward_model` (or point path at checkpoints/shapes_reward)"
        )
    with open(cfg_path) as f:
        meta = json.load(f)
    if [tuple(c) for c in meta.get("classes", [])] != list(CLASSES):
        raise ValueError(
            f"reward model at {path!r} predicts classes {meta.get('classes')}, this code reads {CLASSES}"
        )
    net = SceneNet(SceneNetConfig(**meta["net"]))
    net.load_state_dict(load_file(weights))
    return net.eval()


class ShapesRewardModel:
    """Scorer and `DifferentiableReward`: the learned detector's soft scene check, in [0, 1].

    Args:
        path: a directory written by `python -m worlds.shapes.train_reward_model` (the committed one is
            `checkpoints/shapes_reward`).
        count_tolerance: the count term's width (`scene_score`): a whole object off costs
            exp(-1 / (2 tol^2)) (0.14 at 0.5).
        relation_scale: pixels of relation margin per unit of the relation term's logit.

    The network's weights are frozen (no gradient accumulates in them); it runs on the device
    of the images it is given. A prompt outside the shapes grammar raises ValueError naming it
    (and, as a scorer, its sample id).
    """

    def __init__(
        self,
        path: str = "checkpoints/shapes_reward",
        count_tolerance: float = 0.5,
        relation_scale: float = 2.0,
    ) -> None:
        if not count_tolerance > 0:
            raise ValueError(f"ShapesRewardModel count_tolerance must be > 0, got {count_tolerance}")
        if not relation_scale > 0:
            raise ValueError(f"ShapesRewardModel relation_scale must be > 0, got {relation_scale}")
        self.path = path
        self.count_tolerance = count_tolerance
        self.relation_scale = relation_scale
        self.net = load_scene_net(path)
        self.net.requires_grad_(False)

    def heat(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 12, 16, 16] predicted centre heat of float images [B, 3, 32, 32] in [0, 1] (graph kept)."""
        self.net.to(images.device)
        return self.net(images.float())[1]

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] = ()
    ) -> torch.Tensor:
        """[B] soft scene scores in [0, 1] of float images [B, 3, 32, 32] in [0, 1], with the graph."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        specs = [parse_prompt(p) for p in prompts]
        return scene_score(self.heat(images), specs, self.count_tolerance, self.relation_scale)

    @torch.no_grad()
    def verdicts(self, images: torch.Tensor, prompts: Sequence[str]) -> list[dict[str, Any]]:
        """`score_scene` of the model's `predicted_detections`, per image (float [B, 3, 32, 32] in
        [0, 1]): its strict / colour / shape / count / position verdicts."""
        dets = predicted_detections(self.heat(images))
        return [score_scene(parse_prompt(p), d) for p, d in zip(prompts, dets, strict=True)]

    @torch.no_grad()
    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        images = req.require_images("ShapesRewardModel")
        for sid, p in zip(req.sample_ids, req.prompts, strict=True):
            try:
                parse_prompt(p)
            except ValueError as e:
                raise ValueError(f"sample {sid!r}: {e}") from e
        return self.score_differentiable(images.float() / 255.0, req.prompts).cpu()
