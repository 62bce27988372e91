"""ReFL (ImageReward, Xu et al., 2023): score the one-step x0 prediction at a random late step.

Per sample a step t is drawn uniformly from the steps of `step_window` (fractions of T, as
`sampling.sde_window`); the stored rollout latent x_t (sampled without gradient) gets one
velocity forward with the graph and the one-step prediction x0 = x_t - sigma_t v(x_t) (flow
matching: x_t = (1 - sigma) x0 + sigma eps, v = eps - x0) is decoded and scored:
L = -lambda mean r(decode(x0)). No chain, so one forward and backward per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from unirl.algorithms.reward_backprop import RewardBackprop, RewardBackpropConfig, sample_generator
from unirl.models.stage import DifferentiableDiffusionStage
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class ReFLConfig(RewardBackpropConfig):
    """ReFL settings (plus the shared `RewardBackpropConfig` keys).

    Attributes:
        step_window: (lo, hi) fractions of T; t is drawn uniformly from steps
            [floor(lo T), max(floor(lo T) + 1, floor(hi T))), late steps by default.
    """

    step_window: tuple[float, float] = (0.5, 1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.step_window = tuple(self.step_window)
        lo, hi = self.step_window
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"algorithm.config.step_window must satisfy 0 <= lo < hi <= 1, got {list(self.step_window)}"
            )


class ReFL(RewardBackprop):
    """ReFL on a diffusion track (see the module docstring)."""

    Config: ClassVar[type] = ReFLConfig

    def step_range(self, num_steps: int) -> range:
        """The steps t is drawn from, for a schedule of `num_steps` steps."""
        lo_f, hi_f = self.config.step_window
        lo = math.floor(lo_f * num_steps + 1e-9)
        return range(lo, max(lo + 1, math.floor(hi_f * num_steps + 1e-9)))

    def final_latents(
        self, stage: DifferentiableDiffusionStage, track: RolloutTrack
    ) -> tuple[torch.Tensor, list[int], dict[str, float]]:
        seg = track.segment
        steps = self.step_range(seg.num_steps)
        ts = [
            steps[
                int(
                    torch.randint(
                        0, len(steps), (1,), generator=sample_generator(self.config.seed, sid, "refl")
                    )
                )
            ]
            for sid in track.sample_ids
        ]
        x_t = torch.stack([seg.at(t)[b] for b, t in enumerate(ts)])
        sigma = seg.sigmas[ts]
        v = stage.velocity(x_t, sigma, track.conditions, seg.guidance_scale)
        x0 = x_t.float() - sigma.view(-1, *([1] * (x_t.dim() - 1))) * v
        return x0, list(range(len(track))), {"backprop/sigma_mean": float(sigma.mean())}
