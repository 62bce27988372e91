"""Guidance styles: how a flow family turns its one-branch network call into the guided velocity.

A family's bundle inherits one of these (or writes its own in its folder: a new style is one
family file, the shared stage never branches on it). Each sets the family's `guidance` name (read
by the validator and the supervised losses, `training_guidance`), whether the stage encodes the
unconditional twins of the prompt (`encodes_uncond`), and `guided_velocity`, which the stage calls
for every sampling, replay and denoising step.

`forward(x, sigma, cond, **extra)` is the stage's network call (the family's `predict` on the
module being trained, under autocast when set): x [B, *latent_shape] fp32, sigma [B] fp32, `cond`
the family's keys [B, ...]; it returns the velocity [B, *latent_shape] fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

NEGATIVE = "negative_"
"""Prefix of the unconditional (classifier-free guidance) twin of a conditioning key:
`cond["negative_" + k]` is the uncond branch's value of `cond[k]`."""

Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Uncond:
    """How a guided call runs its unconditional branch (and a style's other extra branches, such
    as LTX-2's perturbed ones): `detach`, without autograd (its velocity a constant of the loss);
    `separate`, in a forward of its own rather than batched beside the cond half (a sampling
    step whose graph is kept then keeps only the cond half's activations)."""

    detach: bool = True
    separate: bool = False

    def context(self) -> contextlib.AbstractContextManager:
        """`no_grad` when `detach`, else a no-op."""
        return torch.no_grad() if self.detach else contextlib.nullcontext()


class _Branches:
    """What every style reads of the conditions: one branch's `cond_keys` (the cond branch, or the
    `NEGATIVE` twins), and the uncond forward's autograd setting."""

    cond_keys: tuple[str, ...]
    shared_keys: tuple[str, ...] = ()  # keys both branches read as they are (an edit's references)

    def branch(self, cond: dict, negative: bool = False) -> dict:
        return {
            k: cond[NEGATIVE + k if negative and k not in self.shared_keys else k] for k in self.cond_keys
        }


class _TwoBranches(_Branches):
    """What the two-branch styles ("cfg", "true_cfg") share: at `scale` <= 1 the cond branch alone
    (whether the uncond branch runs at all is `scale`'s alone, as in the pipelines); else the
    style's `branches` (v_uncond, v_cond), combined by `combine_guidance` at `row_scales`."""

    encodes_uncond = True

    def row_scales(self, sigma: torch.Tensor, scale: float) -> float | torch.Tensor:
        """The scale each row's branches combine with: `scale` (a family whose pipeline guides
        some steps with another scale overrides it: Wan 2.2's low-noise expert, `guidance_scale_2`;
        Z-Image's truncation)."""
        return scale

    @staticmethod
    def combine_guidance(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided velocity from the two branches' [B, *latent_shape] fp32 velocities,
        differentiable in both: v_u + s (v_c - v_u) (a family whose pipeline writes the
        combination another way overrides it, so that sampling equals its pipeline bit for bit:
        Qwen-Image rescales to the norm of v_c, Z-Image writes v_c + (s - 1) (v_c - v_u))."""
        return v_uncond + scale * (v_cond - v_uncond)

    def guided_velocity(
        self, forward: Forward, x: torch.Tensor, sigma: torch.Tensor, cond: dict, scale: float, uncond: Uncond
    ) -> torch.Tensor:
        if scale <= 1.0:
            return forward(x, sigma, self.branch(cond))
        v_uncond, v_cond = self.branches(forward, x, sigma, cond, uncond)
        return self.combine_guidance(v_uncond, v_cond, self.row_scales(sigma, scale))


class ClassifierFreeGuidance(_TwoBranches):
    """ "cfg": v_u + s (v_c - v_u), the cond and `NEGATIVE` halves batched in one forward (or, with
    `uncond.separate`, two; the uncond one without autograd when `uncond.detach`: a sampling step
    whose graph is kept then keeps only the cond half's activations). SD3, Wan."""

    guidance = "cfg"

    def branches(
        self, forward: Forward, x: torch.Tensor, sigma: torch.Tensor, cond: dict, uncond: Uncond
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(v_uncond, v_cond): the two branches' velocities, the `NEGATIVE` and the cond halves
        batched in one forward (or, with `uncond.separate`, two: the uncond one first, without
        autograd when `uncond.detach`); v_uncond detached when `uncond.detach`. A family whose
        pipeline combines them its own way (LTX-2, in x0 form) calls this and combines."""
        positive, negative = self.branch(cond), self.branch(cond, negative=True)
        if uncond.separate:
            with uncond.context():
                v_uncond = forward(x, sigma, negative)
            return v_uncond, forward(x, sigma, positive)
        both = {k: torch.cat([negative[k], positive[k]]) for k in positive}
        v_uncond, v_cond = forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return (v_uncond.detach() if uncond.detach else v_uncond), v_cond


class EmbeddedGuidance(_Branches):
    """ "embedded": the scale is an input of the network (guidance-distilled models): one forward
    with `guidance` = s per row, no uncond branch. FLUX.1-dev."""

    guidance = "embedded"
    encodes_uncond = False

    @staticmethod
    def network_guidance(guidance: torch.Tensor | None, embeds: bool, family: str) -> torch.Tensor | None:
        """`predict`'s `guidance` [B] as the network takes it: required when the transformer embeds
        the scale (`embeds`, FLUX.1-dev / FLUX.2-dev); None for one without the embedding (FLUX.1-
        schnell), which takes only 1.0, i.e. none. ValueErrors name `family` and the fix."""
        if embeds and guidance is None:
            raise ValueError(
                f"this {family} transformer embeds the guidance scale: predict needs guidance [B]"
            )
        if not embeds and guidance is not None and bool((guidance != 1.0).any()):
            raise ValueError(
                f"this {family} transformer has no guidance embedding (guidance_embeds false): "
                "sampling.guidance_scale must be 1.0"
            )
        return guidance if embeds else None

    def guided_velocity(
        self, forward: Forward, x: torch.Tensor, sigma: torch.Tensor, cond: dict, scale: float, uncond: Uncond
    ) -> torch.Tensor:
        return forward(x, sigma, self.branch(cond), guidance=torch.full_like(sigma, scale))


class TrueCFGGuidance(_TwoBranches):
    """ "true_cfg": the cond half, then the `NEGATIVE` half (without autograd when
    `uncond.detach`), in forwards of their own (their conditioning may differ in length),
    combined by the family's `combine_guidance(v_uncond, v_cond, s)`. Qwen-Image (its combine
    rescales to the norm of v_c)."""

    guidance = "true_cfg"

    def branches(
        self, forward: Forward, x: torch.Tensor, sigma: torch.Tensor, cond: dict, uncond: Uncond
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(v_uncond, v_cond): the cond forward, then the `NEGATIVE` one (always separate)."""
        v_cond = forward(x, sigma, self.branch(cond))
        with uncond.context():
            v_uncond = forward(x, sigma, self.branch(cond, negative=True))
        return v_uncond, v_cond
