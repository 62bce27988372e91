"""Rewards over videos ([B, F, 3, H, W] uint8 frames): any image scorer averaged over frames, and
a temporal reward that only motion can earn."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from unirl.types.reward import RewardRequest


class FrameMean:
    """Scorer (and `DifferentiableReward` when the inner one is): an image scorer's score of every
    frame, averaged over the frames of each video.

    The frames of all B videos are scored as one image request of B x F images (sample ids
    `<id>/frame<k>`, each frame with its video's prompt and metadata), then averaged per video.

    Args:
        scorer: an image scorer (e.g. `ColorTarget`), built by Hydra from its node.
    """

    def __init__(self, scorer: Any) -> None:
        if not callable(scorer):
            raise ValueError(
                f"FrameMean scorer must be an image scorer (callable on a request), got {scorer!r}"
            )
        self.scorer = scorer

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32: the mean over frames of the inner scorer's [B * F] frame scores."""
        videos = req.require_videos("FrameMean")
        b, f = videos.shape[:2]
        frames = RewardRequest(
            sample_ids=[f"{sid}/frame{k}" for sid in req.sample_ids for k in range(f)],
            prompts=[p for p in req.prompts for _ in range(f)],
            images=videos.reshape(b * f, *videos.shape[2:]),
            metadata=[m for m in req.metadata for _ in range(f)],
        )
        return self.scorer(frames).to(torch.float32).view(b, f).mean(dim=1)

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """[B] mean over frames of the inner `score_differentiable` of float videos [B, F, 3, H, W]
        in [0, 1], with the graph."""
        if not hasattr(self.scorer, "score_differentiable"):
            raise ValueError(f"FrameMean: its scorer {type(self.scorer).__name__} is not differentiable")
        b, f = images.shape[:2]
        scores = self.scorer.score_differentiable(
            images.reshape(b * f, *images.shape[2:]),
            [p for p in prompts for _ in range(f)],
            [m for m in metadata for _ in range(f)],
        )
        return scores.view(b, f).mean(dim=1)


class ColorMotion:
    """Scorer and `DifferentiableReward`: how far the mass of a colour moves along x from the first
    frame to the last.

    Each pixel p (RGB in [0, 1]) weighs w = max(0, 1 - 2 max_c |p_c - target_c|) (1 at the target
    colour, 0 once any channel is 0.5 away). A frame's centroid is sum(w x) / sum(w) with x the
    pixel column's centre in [0, 1] ((col + 0.5) / W); a frame without mass (sum(w) = 0) counts as
    centred (0.5). The score is centroid(last) - centroid(first), times -1 for `direction: left`:
    in [-1, 1), positive when the colour moved the asked way, 0 for any still video, so only
    motion earns it (with the target red and `right`: a red object moving left to right).

    Args:
        target: RGB colour, three values in [0, 1].
        direction: "right" (x grows over time) or "left".
        floor: None, or the lowest score (0.0: motion the wrong way scores as a still video,
            so a policy cannot raise its reward by no longer moving, only by moving the asked way).
    """

    def __init__(
        self, target: Sequence[float] = (1.0, 0.0, 0.0), direction: str = "right", floor: float | None = None
    ) -> None:
        values = list(target)
        if len(values) != 3 or not all(
            isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0 for v in values
        ):
            raise ValueError(f"ColorMotion target must be 3 RGB values in [0, 1], got {target!r}")
        if direction not in ("right", "left"):
            raise ValueError(f"ColorMotion direction must be 'right' or 'left', got {direction!r}")
        self.target = torch.tensor(values, dtype=torch.float32)
        if floor is not None and (
            isinstance(floor, bool) or not (isinstance(floor, (int, float)) and -1.0 <= floor <= 0.0)
        ):
            raise ValueError(f"ColorMotion floor must be null or in [-1, 0], got {floor!r}")
        self.sign = 1.0 if direction == "right" else -1.0
        self.floor = floor

    def centroids(self, videos: torch.Tensor) -> torch.Tensor:
        """[B, F] x-centroids in [0, 1] of the colour's mass of uint8 videos [B, F, 3, H, W]."""
        return self._centroids(videos.to(torch.float32) / 255.0)

    def _centroids(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, F] x-centroids of float frames [B, F, 3, H, W] in [0, 1], with the graph (a pixel's
        weight is piecewise linear in it, so the centroid moves with the colour's pixels)."""
        target = self.target.to(device=frames.device, dtype=frames.dtype).view(1, 1, 3, 1, 1)
        dist = (frames - target).abs().amax(dim=2)  # [B, F, H, W]
        w = (1.0 - 2.0 * dist).clamp(min=0.0)
        width = w.shape[-1]
        x = (torch.arange(width, dtype=frames.dtype, device=frames.device) + 0.5) / width
        mass = w.sum(dim=(2, 3))
        moment = (w * x).sum(dim=(2, 3))
        return torch.where(mass > 0, moment / mass.clamp(min=1e-12), torch.full_like(mass, 0.5))

    def _score(self, c: torch.Tensor) -> torch.Tensor:
        score = self.sign * (c[:, -1] - c[:, 0])
        return score if self.floor is None else score.clamp(min=self.floor)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32: sign x (centroid of the last frame - centroid of the first), at least `floor`."""
        return self._score(self.centroids(req.require_videos("ColorMotion")))

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """[B] the score of float videos [B, F, 3, H, W] in [0, 1], with the graph (the reward-backprop
        losses' `DifferentiableReward`; prompts and metadata are not read). A frame without the
        colour counts as centred and passes no gradient; the floor, when set, passes none below it."""
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(
                f"ColorMotion scores videos [B, F, 3, H, W], got a tensor of shape {tuple(images.shape)}"
            )
        return self._score(self._centroids(images.float()))
