"""AlignProp (Prabhudesai et al., 2023): backpropagate a differentiable reward through the
sampling chain with randomised truncation and gradient checkpointing.

Per sample a truncation K ~ Uniform{min_steps, ..., max_steps} (max_steps null: T, the whole
chain) is drawn; the sample is re-run from its stored latent x_{T-K} through the last K steps
under the current weights with the graph, and L = -lambda mean r(decode(x_T)). Randomising K
is the paper's guard against over-optimising the reward through the early steps; checkpointing
each step's forward (`checkpoint: true`, the default here) keeps memory at one step's input per
step instead of its activations, so K can be the whole chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

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
class AlignPropConfig(RewardBackpropConfig):
    """AlignProp settings (plus the shared `RewardBackpropConfig` keys; `checkpoint` defaults on).

    Attributes:
        min_steps, max_steps: the range of the truncation K (steps with gradient), drawn
            uniformly per sample; max_steps null is the whole chain (T).
    """

    min_steps: AtLeastOne = 1
    max_steps: int | None = None
    checkpoint: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(
                f"algorithm.config.max_steps={self.max_steps} must be >= algorithm.config.min_steps={self.min_steps}"
            )


class AlignProp(RewardBackprop):
    """AlignProp on a diffusion track (see the module docstring)."""

    Config: ClassVar[type] = AlignPropConfig

    def check_sampling(self, sampling: DiffusionSamplingParams) -> None:
        """The truncation range must fit the schedule: a ValueError naming the keys otherwise."""
        top = self.config.max_steps or self.config.min_steps
        if top > sampling.num_steps:
            key = "max_steps" if self.config.max_steps else "min_steps"
            raise ValueError(
                f"algorithm.config.{key}={top} exceeds sampling.num_steps={sampling.num_steps}: K counts sampling steps"
            )

    def truncations(self, track: RolloutTrack) -> list[int]:
        """K per sample, uniform in [min_steps, max_steps or T], from the sample's generator."""
        n = track.segment.num_steps
        lo, hi = self.config.min_steps, self.config.max_steps or n
        if hi > n:
            raise ValueError(f"algorithm.config.max_steps={hi} exceeds the rollout's {n} sampling steps")
        return [
            int(
                torch.randint(
                    lo, hi + 1, (1,), generator=sample_generator(self.config.seed, sid, "truncation")
                )
            )
            for sid in track.sample_ids
        ]

    def final_latents(
        self, stage: DifferentiableDiffusionStage, track: RolloutTrack
    ) -> tuple[torch.Tensor, list[int], dict[str, float]]:
        ks = self.truncations(track)
        n = track.segment.num_steps
        x = truncated_chain(
            stage, track.segment, track.conditions, [n - k for k in ks], self.config.checkpoint
        )
        return x, list(range(len(track))), {"backprop/steps_mean": sum(ks) / len(ks)}
