"""DRaFT-K and DRaFT-LV (Clark et al., 2023): backpropagate a differentiable reward through the
last K sampling steps.

DRaFT-K: each sample is re-run from its stored latent x_{T-K} (the rollout's own, held fixed)
through the last K steps under the current weights; L = -lambda mean r(decode(x_T)). On the one
update per rollout the re-run equals the rollout's sample, so the gradient is exactly the
reward's, truncated before step T-K (no gradient reaches an earlier step).

DRaFT-LV (`lv_draws: n > 0`), the low-variance variant: the final sample x_0 (held fixed) is
re-noised n times to the noise level of step T-K, x = (1 - sigma_{T-K}) x_0 + sigma_{T-K} eps,
and each copy is denoised through the last K steps with the graph; the loss averages the reward
over the n copies (the paper's K = 1 case re-noises to the last step's level). With a schedule
whose last step is tiny (the SD3 schedules end at sigma ~0.001 -> 0) K = 1 moves almost nothing:
use K >= 2 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import torch
from annotated_types import Ge

from unirl.algorithms.reward_backprop import (
    RewardBackprop,
    RewardBackpropConfig,
    sample_generator,
    truncated_chain,
)
from unirl.models.stage import DifferentiableDiffusionStage
from unirl.types.constraints import AtLeastOne
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import DiffusionSamplingParams


@dataclass
class DRaFTConfig(RewardBackpropConfig):
    """DRaFT settings (plus the shared `RewardBackpropConfig` keys).

    Attributes:
        steps: K, the sampling steps the reward is backpropagated through (1 <= K <= T).
        lv_draws: n > 0 selects DRaFT-LV with n re-noisings of the final sample; 0: DRaFT-K.
    """

    steps: AtLeastOne = 1  # K, the steps with gradient
    lv_draws: Annotated[int, Ge(0)] = 0  # 0: DRaFT-K


class DRaFT(RewardBackprop):
    """DRaFT-K / DRaFT-LV on a diffusion track (see the module docstring)."""

    Config: ClassVar[type] = DRaFTConfig

    def check_sampling(self, sampling: DiffusionSamplingParams) -> None:
        """K must fit the schedule: a ValueError naming both keys otherwise."""
        if self.config.steps > sampling.num_steps:
            raise ValueError(
                f"algorithm.config.steps={self.config.steps} exceeds sampling.num_steps={sampling.num_steps}: "
                "K counts sampling steps"
            )

    def final_latents(
        self, stage: DifferentiableDiffusionStage, track: RolloutTrack
    ) -> tuple[torch.Tensor, list[int], dict[str, float]]:
        cfg, seg = self.config, track.segment
        n = seg.num_steps
        if cfg.steps > n:
            raise ValueError(f"algorithm.config.steps={cfg.steps} exceeds the rollout's {n} sampling steps")
        start = n - cfg.steps
        metrics = {"backprop/steps_mean": float(cfg.steps)}
        if cfg.lv_draws == 0:
            x = truncated_chain(stage, seg, track.conditions, [start] * len(track), cfg.checkpoint)
            return x, list(range(len(track))), metrics
        k = cfg.lv_draws
        shape = seg.final.shape[1:]
        eps = torch.stack(
            [
                torch.randn((k, *shape), generator=sample_generator(cfg.seed, sid, "lv"))
                for sid in track.sample_ids
            ]
        ).flatten(0, 1)
        x0 = seg.final.float().repeat_interleave(k, dim=0)
        sigma = seg.sigmas[start]
        x = ((1 - sigma) * x0 + sigma * eps.to(x0.device)).to(seg.final.dtype)
        cond = {key: v.repeat_interleave(k, dim=0) for key, v in track.conditions.items()}
        x = stage.denoise(x, seg.sigmas, cond, seg.guidance_scale, range(start, n), cfg.checkpoint)
        return x, [b for b in range(len(track)) for _ in range(k)], metrics
