"""A learned, differentiable reward for the shapes world: a small prompt-conditioned CNN that
predicts `GenEvalMini`'s verdicts for an image and its parsed prompt.

`encode_scene(spec)` turns a prompt's `SceneSpec` into a 25-dim vector (category, the two
objects' colour and shape, the number of objects drawn, the relation). `RewardNet` reads an
RGB image in [0, 1] with two coordinate channels, modulates every conv layer by the prompt
vector (FiLM), and outputs one logit per verdict of `HEADS`:

    strict     every wanted object exactly matched, no extra object, relation holds
    color      every wanted object's matched detection has the right colour
    shape      ... the right shape
    count      (counting prompts) exactly k detections of the wanted colour and shape
    position   (position prompts) both objects exact and the relation holds

`ShapesRewardModel` is a reward component like any other (`scorer(req) -> [B]` on uint8
images) and a `DifferentiableReward` (`score_differentiable` on float images in [0, 1], with
the graph): the score is the predicted probability of the `head` verdict (default strict), in
[0, 1]. It is trained by `python -m unirl.train_reward_model` on renders, perturbed renders and
samples of the committed base, all labelled by `GenEvalMini` on training prompts only
(`checkpoints/shapes_reward/TRAINING.md`).
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

from unirl.shapes.world import CATEGORIES, COLORS, RELATIONS, SHAPES, SceneSpec, parse_prompt
from unirl.types.reward import RewardRequest

HEADS: tuple[str, ...] = ("strict", "color", "shape", "count", "position")
"""The verdicts the network predicts, in logit order (`score_scene`'s flags)."""
SCENE_DIM = len(CATEGORIES) + 2 * (len(COLORS) + len(SHAPES)) + 3 + len(RELATIONS)
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def encode_scene(spec: SceneSpec) -> torch.Tensor:
    """[SCENE_DIM] fp32: one-hots of the category, object A's colour and shape, object B's (zeros
    when there is none), the number of objects drawn (1, 2 or 3) and the relation (zeros if none)."""
    parts = [torch.zeros(len(CATEGORIES))]
    parts[0][CATEGORIES.index(spec.category)] = 1
    for j in range(2):
        col, shp = torch.zeros(len(COLORS)), torch.zeros(len(SHAPES))
        if j < len(spec.objects):
            col[COLORS.index(spec.objects[j].color)] = 1
            shp[SHAPES.index(spec.objects[j].shape)] = 1
        parts += [col, shp]
    n = torch.zeros(3)
    n[len(spec.rendered_objects()) - 1] = 1
    rel = torch.zeros(len(RELATIONS))
    if spec.relation is not None:
        rel[RELATIONS.index(spec.relation)] = 1
    return torch.cat([*parts, n, rel])


def head_mask(spec: SceneSpec) -> torch.Tensor:
    """[len(HEADS)] fp32: 1 where the verdict applies to the prompt (count: counting prompts,
    position: position prompts; the rest always)."""
    return torch.tensor(
        [1.0, 1.0, 1.0, float(spec.category == "counting"), float(spec.category == "position")]
    )


@dataclass
class RewardNetConfig:
    """Widths of `RewardNet`: conv channels of the four layers and the hidden MLP width."""

    channels: tuple[int, ...] = (16, 32, 32, 32)
    hidden: int = 128
    size: int = 32

    def __post_init__(self) -> None:
        self.channels = tuple(self.channels)
        if len(self.channels) != 4 or min(self.channels) < 1 or self.hidden < 1 or self.size % 4:
            raise ValueError(
                f"RewardNetConfig needs 4 channel widths >= 1, hidden >= 1, size % 4 == 0: {self}"
            )


class RewardNet(torch.nn.Module):
    """[B, 3, S, S] images in [0, 1] + [B, SCENE_DIM] prompt codes -> [B, len(HEADS)] logits.

    conv 3x3 (S x S) -> stride-2 conv (S/2) -> stride-2 conv (S/4) -> conv (S/4), each
    followed by FiLM from the prompt code (scale 1 + gamma, shift beta) and ReLU; the
    S/4 x S/4 map is flattened with its positions (relations need them), concatenated with
    the prompt code and read by a two-layer MLP.
    """

    def __init__(self, cfg: RewardNetConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or RewardNetConfig()
        c = cfg.channels
        self.convs = torch.nn.ModuleList(
            [
                torch.nn.Conv2d(5, c[0], 3, padding=1),
                torch.nn.Conv2d(c[0], c[1], 3, stride=2, padding=1),
                torch.nn.Conv2d(c[1], c[2], 3, stride=2, padding=1),
                torch.nn.Conv2d(c[2], c[3], 3, padding=1),
            ]
        )
        self.film = torch.nn.Linear(SCENE_DIM, 2 * sum(c))
        flat = c[3] * (cfg.size // 4) ** 2
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(flat + SCENE_DIM, cfg.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden, len(HEADS)),
        )
        ys, xs = torch.meshgrid(
            torch.linspace(-1, 1, cfg.size), torch.linspace(-1, 1, cfg.size), indexing="ij"
        )
        self.register_buffer("coords", torch.stack([xs, ys])[None], persistent=False)

    def forward(self, images: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        if tuple(images.shape[1:]) != (3, self.cfg.size, self.cfg.size):
            raise ValueError(
                f"RewardNet needs [B, 3, {self.cfg.size}, {self.cfg.size}] images, got {list(images.shape)}"
            )
        h = torch.cat([images * 2 - 1, self.coords.to(images.dtype).expand(b, -1, -1, -1)], dim=1)
        film = self.film(codes).split([n for c in self.cfg.channels for n in (c, c)], dim=1)
        for k, conv in enumerate(self.convs):
            gamma, beta = film[2 * k], film[2 * k + 1]
            h = F.relu(conv(h) * (1 + gamma[:, :, None, None]) + beta[:, :, None, None])
        return self.mlp(torch.cat([h.flatten(1), codes], dim=1))


def save_reward_net(net: RewardNet, path: str, extra: dict[str, Any] | None = None) -> None:
    """Write `model.safetensors` (fp32) and `config.json` (the widths, the heads, `extra`) under `path`."""
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.detach().cpu().float().contiguous() for k, v in net.state_dict().items()},
        os.path.join(path, WEIGHTS),
    )
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump({"net": asdict(net.cfg), "heads": list(HEADS), **(extra or {})}, f, indent=2)


def load_reward_net(path: str) -> RewardNet:
    """The `RewardNet` saved under `path` by `save_reward_net` (eval mode, fp32)."""
    cfg_path, weights = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
        raise ValueError(
            f"ShapesRewardModel path {path!r} holds no {CONFIG} and {WEIGHTS}: train one with "
            "`python -m unirl.train_reward_model` (or point path at checkpoints/shapes_reward)"
        )
    with open(cfg_path) as f:
        meta = json.load(f)
    if meta.get("heads") != list(HEADS):
        raise ValueError(
            f"reward model at {path!r} predicts {meta.get('heads')}, this code reads {list(HEADS)}"
        )
    net = RewardNet(RewardNetConfig(**meta["net"]))
    net.load_state_dict(load_file(weights))
    return net.eval()


class ShapesRewardModel:
    """Scorer and `DifferentiableReward`: the learned model's predicted probability of a verdict.

    Args:
        path: a directory written by `python -m unirl.train_reward_model` (the committed one is
            `checkpoints/shapes_reward`).
        head: the verdict whose probability is the score, one of `HEADS` ("strict": every
            wanted object right, nothing extra, relation holds; what evaluation counts).

    The network's weights are frozen (no gradient accumulates in them); it runs on the device
    of the images it is given. A prompt outside the shapes grammar raises ValueError naming it
    (and, as a scorer, its sample id).
    """

    def __init__(self, path: str = "checkpoints/shapes_reward", head: str = "strict") -> None:
        if head not in HEADS:
            raise ValueError(f"ShapesRewardModel head must be one of {list(HEADS)}, got {head!r}")
        self.path = path
        self.head = head
        self.net = load_reward_net(path)
        self.net.requires_grad_(False)

    def logits(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """[B, len(HEADS)] logits for float images [B, 3, H, W] in [0, 1] (graph kept)."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        codes = torch.stack([encode_scene(parse_prompt(p)) for p in prompts]).to(images.device, images.dtype)
        self.net.to(images.device)
        return self.net(images, codes)

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] = ()
    ) -> torch.Tensor:
        """[B] P(`head` verdict) in [0, 1] of float images [B, 3, H, W] in [0, 1], with the graph."""
        return torch.sigmoid(self.logits(images, prompts)[:, HEADS.index(self.head)].float())

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
