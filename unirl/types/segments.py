"""Trajectory segments: what a generation stage records for replay.

`LatentSegment` is a diffusion trajectory; `TextSegment` an autoregressive one.
Both are batch dataclasses (see `unirl.types.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LatentSegment:
    """A diffusion trajectory, stored only where replay needs it.

    Trajectory index t in [0, T] names the latent *before* step t (t = T is
    the final sample). Step i maps x_i to x_{i+1} using sigmas[i] -> sigmas[i+1].

    Attributes:
        latents: [B, P, C, H, W] latents at `positions`, in the trajectory dtype.
        positions: sorted trajectory indices held in `latents`; contains i and
            i+1 for every SDE step i, and T.
        sigmas: [T+1] fp32 sigma schedule the rollout used (pinned).
        sde_indices: sorted SDE step indices (K of them).
        log_probs: [B, K] fp32 rollout-time log-probs of the SDE steps
            (Gaussian log-density averaged over non-batch dims).
        eta: SDE noise level the rollout used on SDE steps.
        guidance_scale: CFG scale the rollout used (replay uses the same).
    """

    latents: torch.Tensor
    positions: list[int]
    sigmas: torch.Tensor
    sde_indices: list[int]
    log_probs: torch.Tensor
    eta: float
    guidance_scale: float

    PER_SAMPLE = ("latents", "log_probs")

    def __len__(self) -> int:
        return self.latents.shape[0]

    def __post_init__(self) -> None:
        missing = sorted({p for i in self.sde_indices for p in (i, i + 1)} - set(self.positions))
        if missing:
            raise ValueError(f"LatentSegment lacks trajectory positions {missing} needed by SDE steps")
        if self.latents.shape[1] != len(self.positions):
            raise ValueError(
                f"LatentSegment.latents holds {self.latents.shape[1]} positions but positions lists "
                f"{len(self.positions)}"
            )
        if self.log_probs.shape != (len(self), len(self.sde_indices)):
            raise ValueError(
                f"LatentSegment.log_probs must be [B={len(self)}, K={len(self.sde_indices)}], "
                f"got {list(self.log_probs.shape)}"
            )

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    def at(self, t: int) -> torch.Tensor:
        """[B, C, H, W] latent before step t (t = T: the final sample)."""
        return self.latents[:, self.positions.index(t)]

    @property
    def final(self) -> torch.Tensor:
        return self.at(self.num_steps)


@dataclass
class TextSegment:
    """An autoregressive trajectory (response tokens of a language stage).

    Attributes:
        tokens: [B, L] long, response tokens right-padded.
        log_probs: [B, L] fp32 rollout-time token log-probs (0 on padding).
        loss_mask: [B, L] float, 1 on tokens that carry loss.
        lengths: [B] long, number of valid response tokens.
    """

    tokens: torch.Tensor
    log_probs: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor

    PER_SAMPLE = ("tokens", "log_probs", "loss_mask", "lengths")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __post_init__(self) -> None:
        shape = tuple(self.tokens.shape)
        for name in ("log_probs", "loss_mask"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"TextSegment.{name} must have the shape of tokens {list(shape)}")
        if tuple(self.lengths.shape) != shape[:1]:
            raise ValueError(f"TextSegment.lengths must be [B={shape[0]}]")
