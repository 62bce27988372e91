"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process.

No log-probs: rollouts may be plain ODE samples (eta = 0). For each final
sample x0 with advantage A (c = `adv_clip`):
    r = clip(clip(A, -c, c) / c / 2 + 0.5, 0, 1)                  optimality in [0, 1]
    x_t = (1 - t) x0 + t eps                   t, eps drawn by the forward-process base (forward_process.py)
    v+ = beta v_new + (1 - beta) v_old,  v- = (1 + beta) v_old - beta v_new
    x0± = x_t - t v±
    L = c * mean_{i,draws}( r mse(x0+) + (1 - r) mse(x0-) ) / beta
where mse(y) = mean((y - x0)^2) / sg(mean|y - x0|) over non-batch dims (the
adaptive weight), and v_old is the velocity of the weights that sampled the
batch, frozen before the first update. On the first update v_new = v_old, so
the gradient is A times the gradient of the weighted flow-matching error:
samples better than their group are pulled toward, worse ones pushed from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.forward_process import ForwardProcessAlgorithm, ForwardProcessConfig, per_row
from unirl.models.stage import DiffusionStage
from unirl.types.constraints import Positive
from unirl.types.rollout_resp import RolloutTrack

# per-sample entries prepare_segment adds to `track.conditions` (they travel with `select`)
NFT_PREFIX = "nft/"
SIGMA_KEY, NOISE_KEY, V_OLD_KEY = NFT_PREFIX + "sigma", NFT_PREFIX + "noise", NFT_PREFIX + "v_old"


@dataclass
class DiffusionNFTConfig(ForwardProcessConfig):
    """DiffusionNFT loss settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        beta: strength of the implicit positive / negative policies (> 0; the
            reference uses 1.0).
        adv_clip: c, the advantage clip that maps A to r in [0, 1] (reference 5.0).

    The defaults of the forward-process keys are the reference's draws: t uniform over the
    rollout's sigma schedule sigmas[0..T-1] (`discrete_with_init` over [0, 1]), one fresh
    eps per sample (`draws_per_sample` draws, each one denoiser forward).
    """

    beta: Positive = 1.0
    adv_clip: Positive = 5.0


def optimality(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """[B] r = clip(clip(A, -c, c) / c / 2 + 0.5, 0, 1)."""
    return (adv.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0.0, 1.0)


def adaptive_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[N] mean((pred - target)^2) / sg(mean|pred - target|) over non-batch dims."""
    dims = tuple(range(1, pred.dim()))
    err = pred - target
    scale = err.detach().abs().mean(dim=dims).clamp(min=1e-5)
    return (err**2).mean(dim=dims) / scale


def nft_loss(
    v_new: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    clip: float,
) -> torch.Tensor:
    """Scalar DiffusionNFT loss; v_new, v_old, x_t, x0 [N, C, h, w], sigma and r [N]."""
    s = per_row(sigma, x_t)
    x0_pos = x_t - s * (beta * v_new + (1 - beta) * v_old)
    x0_neg = x_t - s * ((1 + beta) * v_old - beta * v_new)
    per = r * adaptive_mse(x0_pos, x0) + (1 - r) * adaptive_mse(x0_neg, x0)
    return clip * per.mean() / beta


class DiffusionNFT(ForwardProcessAlgorithm):
    """DiffusionNFT on a diffusion track: uses only the final latents and the advantages."""

    prefix: ClassVar[str] = NFT_PREFIX

    Config: ClassVar[type] = DiffusionNFTConfig

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (sigma, eps) per sample and freeze v_old under the weights that sampled the batch."""
        track = self.with_draws(track)
        x_t, _, flat_sigma, cond = self.inputs(track)
        v_old = stage.velocity(x_t, flat_sigma, cond, track.segment.guidance_scale)
        v_old = v_old.view(len(track), self.config.draws_per_sample, *v_old.shape[1:])
        track.conditions[V_OLD_KEY] = v_old
        return track

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale` (float). Needs `prepare_segment` to have run on `track`."""
        cfg = self.config
        self.check_prepared(track, V_OLD_KEY)
        x_t, x0, sigma, cond = self.inputs(track)
        v_new = stage.velocity(x_t, sigma, cond, track.segment.guidance_scale)
        v_old = track.conditions[V_OLD_KEY].flatten(0, 1)
        r = optimality(track.advantages, cfg.adv_clip).repeat_interleave(cfg.draws_per_sample)
        loss = nft_loss(v_new, v_old, x_t, x0, sigma, r, cfg.beta, cfg.adv_clip)
        (loss * ctx["loss_scale"]).backward()
        with torch.no_grad():
            drift = ((v_new - v_old) ** 2).mean()
            fm = adaptive_mse(x_t - per_row(sigma, x_t) * v_new, x0).mean()
        return {
            "loss": float(loss.detach()),
            "nft/optimality_mean": float(r.mean()),
            "nft/v_drift_mse": float(drift),
            "nft/x0_error": float(fm),
        }
