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
