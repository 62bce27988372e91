"""Trajectory segments: what a generation stage records for replay.

`LatentSegment` is a diffusion trajectory; `TokenSegment` an autoregressive one.
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
        values: [B, K] fp32 critic values of the states before the SDE steps (Flow-PPO:
            `unirl.models.flow.value`), else None.
    """

    latents: torch.Tensor
    positions: list[int]
    sigmas: torch.Tensor
    sde_indices: list[int]
    log_probs: torch.Tensor
    eta: float
    guidance_scale: float
    values: torch.Tensor | None = None

    PER_SAMPLE = ("latents", "log_probs", "values")

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


def pad_right(rows: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    """[B, Lmax] from B 1-D tensors of lengths L_i (right-padded with `value`)."""
    if not rows:
        raise ValueError("cannot pad an empty list of rows")
    width = max(int(r.shape[0]) for r in rows)
    out = rows[0].new_full((len(rows), width), value)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


@dataclass
class TokenSegment:
    """An autoregressive trajectory: a prompt and the response sampled after it.

    Jagged: each sample keeps its own lengths (no padding travels through the
    data plane; `pad_right` pads on the consumer).

    Attributes:
        prompt_ids: per sample [P_i] long, the prompt tokens (chat template applied).
        response_ids: per sample [R_i] long, R_i >= 1: the sampled tokens, the
            stop token included when one ended the response.
        log_probs: per sample [R_i] fp32: the sampled tokens' log-probs at
            rollout time under `log_softmax(logits / temperature)`; an algorithm's
            `prepare_segment` may replace them by replayed pi_old values.
        temperature: the logit divisor sampling used (replay uses the same).
        guidance_scale: an image-token segment's classifier-free guidance scale s (the
            logits are u + s (c - u); replay uses the same); None for text.
        ref_log_probs: per sample [R_i] fp32 reference-policy log-probs when the
            rollout computed them (KL folded into the reward), else None.
        values: per sample [R_i] fp32 critic values V_t (of the state before response
            token t) when the run has a critic (PPO), else None.
        rollout_log_probs: per sample [R_i] fp32, the engine's recorded log-probs, kept by a
            `prepare_segment` that replaced `log_probs` by the trainer's replay (the
            rollout-training mismatch is measured and corrected against them); else None.
        pixel_values: a vision-language model's prompt images, per sample [N_i, D] fp32
            (the image processor's flattened patches of the sample's k_i images, N_i = 0
            without images); None for text-only models.
        image_grid_thw: per sample [k_i, 3] long, the (t, h, w) patch grid of each image,
            in prompt order; set exactly when `pixel_values` is.
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    temperature: float = 1.0
    ref_log_probs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    rollout_log_probs: list[torch.Tensor] | None = None
    pixel_values: list[torch.Tensor] | None = None
    image_grid_thw: list[torch.Tensor] | None = None
    guidance_scale: float | None = None

    PER_SAMPLE = (
        "prompt_ids",
        "response_ids",
        "log_probs",
        "ref_log_probs",
        "values",
        "rollout_log_probs",
        "pixel_values",
        "image_grid_thw",
    )

    def __len__(self) -> int:
        return len(self.response_ids)

    def __post_init__(self) -> None:
        # the data plane hands jagged fields back as nested tensors; keep lists
        for name in self.PER_SAMPLE:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.is_nested:
                setattr(self, name, list(value.unbind()))
        n = len(self.response_ids)
        if len(self.prompt_ids) != n:
            raise ValueError(f"TokenSegment has {len(self.prompt_ids)} prompts for {n} responses")
        for i, r in enumerate(self.response_ids):
            if r.dim() != 1 or r.numel() < 1:
                raise ValueError(
                    f"TokenSegment.response_ids[{i}] must be 1-D with >= 1 token, got {list(r.shape)}"
                )
        for name in ("log_probs", "ref_log_probs", "values", "rollout_log_probs"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"TokenSegment.{name} has {len(rows)} rows for {n} responses")
            for i, (lp, r) in enumerate(zip(rows, self.response_ids, strict=True)):
                if lp.shape != r.shape:
                    raise ValueError(
                        f"TokenSegment.{name}[{i}] has shape {list(lp.shape)}, its response {list(r.shape)}"
                    )
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("TokenSegment.pixel_values and image_grid_thw must be set together")
        if self.pixel_values is not None:
            for name in ("pixel_values", "image_grid_thw"):
                if len(getattr(self, name)) != n:
                    raise ValueError(
                        f"TokenSegment.{name} has {len(getattr(self, name))} rows for {n} responses"
                    )
            for i, grid in enumerate(self.image_grid_thw):
                if grid.dim() != 2 or grid.shape[-1] != 3:
                    raise ValueError(
                        f"TokenSegment.image_grid_thw[{i}] must be [k, 3], got {list(grid.shape)}"
                    )
                patches = int(grid.prod(-1).sum()) if grid.numel() else 0
                if self.pixel_values[i].shape[0] != patches:
                    raise ValueError(
                        f"TokenSegment.pixel_values[{i}] has {self.pixel_values[i].shape[0]} patches but its "
                        f"grids image_grid_thw[{i}] hold {patches}"
                    )

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long."""
        return torch.tensor([int(r.numel()) for r in self.response_ids], dtype=torch.long)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[B] long."""
        return torch.tensor([int(p.numel()) for p in self.prompt_ids], dtype=torch.long)

    def response_mask(self) -> torch.Tensor:
        """[B, Rmax] fp32: 1 on response tokens, 0 on right padding."""
        return pad_right([torch.ones(r.numel(), device=r.device) for r in self.response_ids])

    def padded(self, name: str, value: float = 0) -> torch.Tensor:
        """[B, Rmax] the per-token field `name` ("response_ids", "log_probs", "ref_log_probs", "values",
        "rollout_log_probs")
        right-padded with `value`."""
        rows = getattr(self, name)
        if rows is None:
            raise ValueError(f"TokenSegment.{name} is not set")
        return pad_right(rows, value)
