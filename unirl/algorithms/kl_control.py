"""The reference-policy / KL-control layer of the diffusion step losses.

Each SDE step is a Gaussian transition `N(mu, std^2 I)`. Two policies that share
the step's noise level differ only in their means, so the KL between their steps
is closed-form:

    KL_t = mean_{non-batch}((mu_a - mu_b)^2) / (2 s^2)

averaged (not summed) over the latent's elements, the convention of the step
log-probs. `s` is the scale the loss names: the step's transition std
(`transition_std`) gives the exact, mean-reduced Gaussian KL (DPOK, Flow-DPPO);
`std_dev_t` as replay returns it is flow_grpo's estimate, which for the Flow and
Dance SDEs (std = std_dev_t sqrt(-dt)) is |dt| times the exact KL: Flow-GRPO
keeps it, so that its `beta` means what it means in flow_grpo.

`KLController` holds the coefficient of a KL-to-reference term: fixed, or adaptive
with the PPO controller of Ziegler et al. (2019):

    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)

once per rollout, where KL is the rollout's mean reference KL over all ranks and n
the number of samples trained on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal

import torch
import torch.distributed as dist

from unirl.models.stage import DiffusionStage
from unirl.sde.strategies import SDEStrategy, make_strategy
from unirl.types.segments import LatentSegment

KL_ERROR_CLIP = 0.2  # Ziegler et al.'s bound on the proportional error
KLSpace = Literal["latent", "velocity"]
"""Where a KL-to-another-policy term measures the distance: "latent" on the latents the
policies produce (a step loss: the SDE step means, the Gaussian KL; a forward-process
loss: the clean-latent predictions x_s - s v), "velocity" on the velocities themselves."""


def step_kl(means: torch.Tensor, other: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, k] per-step KL `mean_{C,h,w}((means - other)^2) / (2 scale^2)`; means and other
    [B, k, C, h, w], scale [k] (one value per step)."""
    return ((means - other) ** 2).mean(dim=tuple(range(2, means.dim()))) / (2 * scale**2)


def stage_strategy(stage: DiffusionStage, segment: LatentSegment, purpose: str) -> SDEStrategy:
    """The stage's SDE strategy (`stage.sde`) at the segment's eta; a TypeError saying what
    `purpose` needs of it when the stage names none."""
    name = getattr(stage, "sde", None)
    if name is None:
        raise TypeError(f"{type(stage).__name__} names no SDE strategy (`sde`); {purpose}")
    return make_strategy(name, segment.eta)


def transition_std(stage: DiffusionStage, segment: LatentSegment, steps: list[int]) -> torch.Tensor:
    """[k] fp32 transition std of SDE steps `steps` under the stage's SDE strategy (`stage.sde`)
    and the segment's eta and sigmas: `std_dev_t * sqrt(-dt)` for the Flow-GRPO and DanceGRPO
    SDEs, `sigma' sin(eta pi/2)` for CPS. A step's std does not depend on x or v (the
    policy only moves the mean), so it is read off the strategy at x = v = 0."""
    strategy = stage_strategy(stage, segment, "the exact step KL needs its transition std")
    zero = torch.zeros(1, dtype=torch.float32, device=segment.sigmas.device)
    return torch.stack([strategy.mean_and_std(zero, zero, segment.sigmas, i)[1] for i in steps]).float()


def velocity_scale(stage: DiffusionStage, segment: LatentSegment, steps: list[int]) -> torch.Tensor:
    """[k] fp32 c_t with mu(x, v) - mu(x, v') = c_t (v - v') for each SDE step: every step mean
    (flow, dance, CPS) is affine in the velocity, so c_t = mu(0, 1) - mu(0, 0), read off the
    stage's SDE strategy. `step_kl(means, other, |c_t| / sqrt(2))` is then
    mean((v - v_other)^2), the KL term on velocities."""
    strategy = stage_strategy(stage, segment, "a velocity KL needs its step means")
    zero = torch.zeros(1, dtype=torch.float32, device=segment.sigmas.device)
    one = torch.ones_like(zero)
    return torch.stack(
        [
            (
                strategy.mean_and_std(zero, one, segment.sigmas, i)[0]
                - strategy.mean_and_std(zero, zero, segment.sigmas, i)[0]
            )
            .reshape(())
            .float()
            for i in steps
        ]
    )


@torch.no_grad()
def reference_means(
    stage: DiffusionStage,
    segment: LatentSegment,
    cond: dict,
    steps: list[int],
    reference: Callable[[], AbstractContextManager],
) -> torch.Tensor:
    """[B, k, C, h, w] step means of the reference policy (`reference()`: the train backend's
    context switching to it: LoRA disabled, or a full fine-tune's frozen initial weights).
    Call it before the policy's own forward: a full fine-tune swaps weights in place."""
    with reference():
        return stage.replay(segment, cond, steps)[1]


def mean_over_ranks(value: float, device: torch.device) -> float:
    """`value` averaged over the data-parallel ranks (collective: call it on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


class KLController:
    """The coefficient of a KL-to-reference loss term.

    Args:
        beta: the coefficient (the initial one when adaptive); 0 disables the term.
        target: the KL per step the adaptive controller steers to; None keeps `beta` fixed.
        horizon: samples over which a full proportional error (clipped to +-0.2) changes
            beta by 20% (Ziegler et al.: 10000).
    Raises ValueError naming the `algorithm.config` key of a bad value.
    """

    def __init__(self, beta: float, target: float | None = None, horizon: int = 10000) -> None:
        if not (beta >= 0 and math.isfinite(beta)):
            raise ValueError(f"algorithm.config.beta must be >= 0, got {beta}")
        if target is not None and not (target > 0 and math.isfinite(target)):
            raise ValueError(f"algorithm.config.kl_target must be > 0 or null (a fixed beta), got {target}")
        if target is not None and beta == 0:
            raise ValueError(
                "algorithm.config.kl_target is set but beta=0: the adaptive controller multiplies beta, "
                "so set beta > 0 as its initial value (or kl_target: null)"
            )
        if horizon < 1:
            raise ValueError(f"algorithm.config.kl_horizon must be >= 1, got {horizon}")
        self.value = float(beta)
        self.target = target
        self.horizon = horizon

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, kl: float, num_samples: int) -> float:
        """One controller step after a rollout whose mean KL was `kl` over `num_samples`
        samples; returns the new coefficient (unchanged when fixed)."""
        if self.adaptive:
            error = min(max(kl / self.target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
            self.value *= 1.0 + error * num_samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
