"""Reward backpropagation: the loss is minus a differentiable reward of samples re-computed
with the autograd graph through the last sampling steps (DRaFT, AlignProp, ReFL).

The rollout is an ordinary ODE rollout (`sampling.eta: 0`) whose stage stores the whole
trajectory (`stage.store_trajectory: true`): the latent x_i before every step i. The loss
restarts the sampler from a stored x_s under the current weights (`stage.denoise`, the same
arithmetic as the rollout, so on the one update per rollout it recomputes the rollout's own
samples exactly), keeps the graph from step s on, decodes (`stage.decode_float`) and scores
(`reward.score_differentiable`):

    L = -reward_scale * mean_b r(decode(x_T^b(theta)))  [+ kl_coef * KL]

with x_s held fixed: the gradient is truncated before step s (DRaFT-K: s = T - K). Each
algorithm chooses s per sample (or, ReFL, a one-step x0 prediction instead of the chain) in
`final_latents`; this module holds what they share: the per-sample truncated chain, the
reward, the optional regulariser to the base and the metrics.

Regulariser (`kl_coef > 0`): at `kl_steps` stored positions x_j per sample (j drawn from the
schedule's steps), `mean ||v_theta(x_j) - v_ref(x_j)||^2` over non-batch dims and draws, v_ref
the reference policy's velocity (LoRA disabled, or the frozen initial weights). For two flows
with the same noise this is, up to the SDE's noise scale, the per-step KL of their path
measures along the rollout's own trajectory; it pulls the velocity field back to the base.

Randomness (truncation points, re-noising, regulariser steps) comes from one generator per
sample seeded by (`seed`, sample id, purpose), so batching, rank and resume do not change it.
"""

from __future__ import annotations

import zlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.kl_control import KLSpace
from unirl.models.stage import DifferentiableDiffusionStage
from unirl.types.constraints import AtLeastOne, NonNegative, Positive, check_fields
from unirl.types.reward import DifferentiableReward
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment

RewardTransform = Literal["identity", "log"]


@dataclass
class RewardBackpropConfig:
    """Settings every reward-backprop loss shares.

    Attributes:
        reward_scale: lambda, the loss is -lambda * mean reward (> 0).
        reward_transform: "identity" (the reward itself) or "log" (log max(r, 1e-30), for a
            reward in (0, 1]: a product of terms becomes a sum, and a sample far from the
            optimum keeps a gradient its small reward would scale away).
        kl_coef: weight of the velocity-L2 regulariser to the reference policy (0: off,
            no reference forward).
        kl_steps: stored trajectory positions per sample the regulariser is evaluated at.
        kl_space: "velocity" (mean ||v_theta - v_ref||^2) or "latent" (the same on the
            clean-latent predictions x_j - sigma_j v, sigma_j^2 times it).
        checkpoint: recompute each re-run step's forward in the backward pass
            (`torch.utils.checkpoint`), memory for one step's input instead of its activations.
        seed: with the sample id, seeds every random choice of the loss.
    """

    reward_scale: Positive = 1.0
    reward_transform: RewardTransform = "identity"
    kl_coef: NonNegative = 0.0
    kl_steps: AtLeastOne = 1
    kl_space: KLSpace = "velocity"
    checkpoint: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")


def sample_generator(seed: int, sample_id: str, purpose: str) -> torch.Generator:
    """A CPU generator that is a pure function of (seed, sample id, purpose)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{sample_id}:{purpose}".encode()))


def truncated_chain(
    stage: DifferentiableDiffusionStage,
    segment: LatentSegment,
    cond: dict,
    starts: list[int],
    checkpoint: bool = False,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, C, h, w] final latents re-run from step `starts[b]` of each sample, with the graph.

    Row b restarts from its stored latent x_{starts[b]} (or from row b of `x`, the latent
    before step min(starts), when given) and runs steps starts[b]..T-1 under the current
    weights; before its start a row is the stored trajectory (constant), so no gradient
    reaches an earlier step. The steps run batched from min(starts); a row whose window
    has not begun takes its stored next latent after each step (`torch.where`: no gradient
    through the step it skipped).
    """
    n = segment.num_steps
    if len(starts) != len(segment) or not all(0 <= s < n for s in starts):
        raise ValueError(f"starts must be {len(segment)} step indices in [0, {n}), got {starts}")
    first = min(starts)
    late_after = torch.tensor(starts, device=segment.latents.device)
    x = segment.at(first) if x is None else x
    for i in range(first, n):
        x = stage.denoise(x, segment.sigmas, cond, segment.guidance_scale, range(i, i + 1), checkpoint)
        late = late_after > i
        if bool(late.any()):
            x = torch.where(late.view(-1, *([1] * (x.dim() - 1))), segment.at(i + 1), x)
    return x


def velocity_kl(
    stage: DifferentiableDiffusionStage,
    track: RolloutTrack,
    reference,
    steps: int,
    seed: int,
    space: str = "velocity",
) -> torch.Tensor:
    """Scalar mean ||v_theta(x_j) - v_ref(x_j)||^2 at `steps` stored positions j per sample
    (drawn per sample from [0, T)), v_ref under the `reference()` context (no grad); with
    `space="latent"` each row is weighted by sigma_j^2 (the clean-latent predictions
    x_j - sigma_j v)."""
    seg = track.segment
    n = seg.num_steps
    idx = [
        torch.randint(0, n, (steps,), generator=sample_generator(seed, sid, "kl")).tolist()
        for sid in track.sample_ids
    ]
    x = torch.stack([seg.at(js[k])[b] for k in range(steps) for b, js in enumerate(idx)])
    sigma = torch.stack([seg.sigmas[js[k]] for k in range(steps) for js in idx])
    cond = {key: v.repeat(steps, *([1] * (v.dim() - 1))) for key, v in track.conditions.items()}
    v = stage.velocity(x, sigma, cond, seg.guidance_scale)
    with torch.no_grad(), reference():
        v_ref = stage.velocity(x, sigma, cond, seg.guidance_scale)
    if space == "velocity":
        return ((v - v_ref) ** 2).mean()
    return (sigma**2 * ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.dim())))).mean()


class RewardBackprop(StageAlgorithm):
    """The shared loss of the reward-backprop family; a subclass picks the re-computed samples.

    Args:
        config: the subclass's config (a `RewardBackpropConfig`).
        reward: a `DifferentiableReward`; in a recipe, `reward: ${reward}`, the run's own
            reward service (its weighted differentiable components; zero-weight monitors
            are skipped), so the loss differentiates the reward the run logs.

    Class flags beyond `StageAlgorithm`'s, read by the recipe validator:
        requires_trajectory: the stage must store every trajectory position
            (`stage.store_trajectory: true`).
        requires_ode_rollout: rollouts must be ODE samples (`sampling.eta: 0`), which
            `stage.denoise` reproduces.
    """

    modality: ClassVar[str] = "diffusion"
    requires_trajectory: ClassVar[bool] = True
    requires_ode_rollout: ClassVar[bool] = True

    def __init__(self, reward: DifferentiableReward, config: RewardBackpropConfig | None = None) -> None:
        if not isinstance(reward, DifferentiableReward):
            raise TypeError(
                f"algorithm.reward must be a differentiable reward (score_differentiable), got "
                f"{type(reward).__name__}; in a recipe use `reward: ${{reward}}` with differentiable components"
            )
        check = getattr(reward, "check_differentiable", None)
        if callable(check):  # a reward service: its weighted components, checked when the recipe is built
            check()
        super().__init__(config)
        self.reward = reward

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.kl_coef > 0

    @abstractmethod
    def final_latents(
        self, stage: DifferentiableDiffusionStage, track: RolloutTrack
    ) -> tuple[torch.Tensor, list[int], dict[str, float]]:
        """(latents [N, C, h, w] with the graph, the sample index of each row, metrics)."""

    def check(self, stage: Any, track: RolloutTrack) -> None:
        """A clear error when the stage or the rollout cannot be differentiated through."""
        name = type(self).__name__
        if not isinstance(stage, DifferentiableDiffusionStage):
            raise TypeError(
                f"{name} needs a DifferentiableDiffusionStage (denoise, decode_float), got {type(stage).__name__}"
            )
        seg = track.segment
        if not isinstance(seg, LatentSegment):
            raise ValueError(
                f"{name} trains diffusion tracks; track {track.name!r} holds a {type(seg).__name__}"
            )
        if seg.positions != list(range(seg.num_steps + 1)):
            raise ValueError(
                f"{name} restarts the sampler from any step, but track {track.name!r} stores only positions "
                f"{seg.positions}: set stage.store_trajectory: true"
            )
        if seg.sde_indices or seg.eta != 0:
            raise ValueError(
                f"{name} re-runs ODE steps, but track {track.name!r} was sampled with eta={seg.eta} "
                f"(SDE steps {seg.sde_indices}): set sampling.eta: 0"
            )

    def compute_loss_and_backward(
        self, stage: DifferentiableDiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale` (float); `reference` (context-manager factory) when `kl_coef > 0`."""
        self.check(stage, track)
        cfg = self.config
        latents, rows, metrics = self.final_latents(stage, track)
        images = stage.decode_float(latents)
        metadata = list(track.metadata) if track.metadata else [{} for _ in track.sample_ids]
        scores = self.reward.score_differentiable(
            images, [track.prompts[r] for r in rows], [metadata[r] for r in rows]
        )
        objective = scores.clamp(min=1e-30).log() if cfg.reward_transform == "log" else scores
        loss = -cfg.reward_scale * objective.mean()
        out = {"backprop/reward_mean": float(scores.detach().mean())}
        if cfg.kl_coef > 0:
            kl = velocity_kl(stage, track, ctx["reference"], cfg.kl_steps, cfg.seed, cfg.kl_space)
            loss = loss + cfg.kl_coef * kl
            out["kl"] = float(kl.detach())
        (loss * ctx["loss_scale"]).backward()
        with torch.no_grad():
            drift = (latents.detach() - track.segment.final[rows]).abs().mean()
        return {"loss": float(loss.detach()), **out, "backprop/x0_drift": float(drift), **metrics}
