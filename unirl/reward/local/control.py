"""A reward that carries no information: the control beside every learning claim."""

from __future__ import annotations

import hashlib

import torch

from unirl.types.reward import RewardRequest


class RandomReward:
    """Scorer: a uniform [0, 1) draw per sample, a pure function of (`seed`, sample id).

    Independent of what was generated, so a policy trained on it can only drift:
    run a recipe with `weights: {random: 1.0, <real>: 0.0}` (the real component is
    still logged) to measure how far a metric moves without signal. Works for
    images and text alike; deterministic, so a resumed run scores identically.

    Args:
        seed: mixes into every draw (two controls with different seeds are independent).
    """

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"RandomReward seed must be an int, got {seed!r}")
        self.seed = seed

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 draws, one per `req.sample_ids` entry."""
        draws = []
        for sid in req.sample_ids:
            digest = hashlib.blake2b(f"{self.seed}:{sid}".encode(), digest_size=8).digest()
            draws.append(int.from_bytes(digest, "little") / 2**64)
        return torch.tensor(draws, dtype=torch.float32)


class RandomDirectionReward:
    """Scorer and `DifferentiableReward`: the control for reward-backprop algorithms.

    `sigmoid(<w, 2 x - 1> / sqrt(d))` with x the image in [0, 1] (d values) and w a standard
    normal direction drawn from (`seed`, a hash of the image's own uint8 pixels): every image
    is pushed along its own random direction, so the loss's gradient has the size and form of
    a real differentiable reward's and carries nothing about the prompt. Log a real reward at
    weight 0 beside it to measure the drift of updates without signal. The scorer path scores
    `images / 255`, the differentiable path hashes `round(255 x)`, so both use one direction.

    Args:
        seed: mixes into every direction.
    """

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"RandomDirectionReward seed must be an int, got {seed!r}")
        self.seed = seed

    def direction(self, image: torch.Tensor) -> torch.Tensor:
        """The unit-variance direction of one float image [3, H, W] in [0, 1] (a function of its
        rounded pixels and the seed)."""
        pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy().tobytes()
        digest = hashlib.blake2b(pixels, digest_size=8, key=str(self.seed).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.randn(image.shape, generator=gen)

    def score_differentiable(self, images: torch.Tensor, prompts=(), metadata=()) -> torch.Tensor:
        """[B] scores in (0, 1) of float images [B, 3, H, W] in [0, 1], with the graph."""
        w = torch.stack([self.direction(img) for img in images]).to(images.device, images.dtype)
        return torch.sigmoid((w * (2 * images - 1)).flatten(1).sum(1) / images[0].numel() ** 0.5).float()

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8)."""
        return self.score_differentiable(req.require_images("RandomDirectionReward").float() / 255.0).cpu()
