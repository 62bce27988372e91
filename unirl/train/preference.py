"""Offline Diffusion-DPO: preference pairs loaded from a file, trained through the shared
resumable supervised loop (`python -m unirl.train_sft`).

The loss is the online one (`unirl.algorithms.diffusion_dpo.diffusion_dpo_loss`) on
pairs from `unirl.data.PreferencePairsFile` instead of from rollout groups: per pair
one draw (sigma, eps) shared by its two samples, x_t = (1 - sigma) x0 + sigma eps,
err = mean (v_theta(x_t) - (eps - x0))^2 under the trained denoiser and under a frozen
copy of its initial weights (the reference), and
L = mean -log sigmoid(-beta/2 ((err_w - err_ref_w) - (err_l - err_ref_l))).
sigma is drawn as the flow-matching pretraining draws it (`sigma_sampling`, `shift`).
The denoiser is fully fine-tuned (text encoders frozen); resuming restores it while the
reference stays the initial weights (rebuilt from `model`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from unirl.algorithms.diffusion_dpo import diffusion_dpo_loss, flow_matching_error
from unirl.models.flow.family import FlowFamily, training_guidance
from unirl.sde.schedules import sample_sigmas
from unirl.train.sft import FlowObjectiveConfig, export_bundle
from unirl.train.supervised import SupervisedRun
from unirl.types.constraints import AtLeastOne, Positive


@dataclass
class OfflineDiffusionDPOConfig(FlowObjectiveConfig):
    """Settings of an offline Diffusion-DPO run: `FlowObjectiveConfig` (batch_size: pairs per
    step, drawn with replacement) plus

    Attributes:
        beta: the DPO inverse temperature on mean-reduced errors (> 0).
    """

    num_steps: AtLeastOne = 200
    batch_size: AtLeastOne = 16
    lr: Positive = 1e-5
    checkpoint_every: AtLeastOne = 50
    log_every: AtLeastOne = 10
    beta: Positive = 2000.0


class PairSource(Protocol):
    """`sample_batch(n, rng) -> (prompts, chosen [n, C, H, W], rejected [n, C, H, W])`."""

    def sample_batch(
        self, n: int, rng: np.random.Generator
    ) -> tuple[list[str], torch.Tensor, torch.Tensor]: ...


class OfflineDiffusionDPO(SupervisedRun):
    """Trains `bundle`'s denoiser on preference pairs from `data` with the Diffusion-DPO loss.

    Args:
        bundle: a flow-matching bundle (a `FlowFamily`) on the device to train on; the pairs
            are in its model space
            (a pixel-space bundle: images; a latent one: latents of its VAE's shape).
        data: the pair source.
        config: run settings.
        out_dir: where `sft_state.pt` and `metrics.jsonl` go.
        evaluate: optional `evaluate(bundle) -> dict[str, float]`.
    """

    def __init__(
        self,
        bundle: FlowFamily,
        data: PairSource,
        config: OfflineDiffusionDPOConfig,
        out_dir: str,
        evaluate: Callable[[FlowFamily], dict[str, float]] | None = None,
    ) -> None:
        training_guidance(bundle, torch.ones(1), config.guidance_scale)  # refused before any step
        self.bundle, self.data = bundle, data
        self.reference = copy.deepcopy(bundle.denoiser).requires_grad_(False).eval()
        super().__init__([bundle.denoiser], config, out_dir, evaluate, bundle)

    def _errors(self, module: torch.nn.Module, x_t, sigma, cond, x0, eps) -> torch.Tensor:
        guidance = training_guidance(self.bundle, sigma, self.cfg.guidance_scale)
        return flow_matching_error(self.bundle.predict(module, x_t, sigma, cond, **guidance), x0, eps)

    def batch_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """The DPO loss of a fresh batch of pairs (two forwards of 2n samples: policy, reference)."""
        cfg = self.cfg
        prompts, chosen, rejected = self.data.sample_batch(cfg.batch_size, self.rng)
        device = self.bundle.device
        want = self.bundle.latent_shape(chosen.shape[-2] * self._scale(), chosen.shape[-1] * self._scale())
        if tuple(chosen.shape[1:]) != tuple(want):
            raise ValueError(
                f"the pairs are samples of shape {list(chosen.shape[1:])}, but the model denoises {list(want)} "
                "(a pixel-space model takes RGB images of its resolution; a latent model latents of its VAE)"
            )
        n = len(prompts)
        x0 = torch.cat([chosen, rejected]).to(device)
        eps = torch.randn(chosen.shape, generator=self.gen).to(device)
        sigma = sample_sigmas(n, cfg, self.gen).to(device)
        eps, sigma = torch.cat([eps, eps]), torch.cat([sigma, sigma])  # one draw per pair
        s = sigma.view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        with torch.no_grad():
            cond = self.bundle.encode_text(prompts, False, cfg.max_sequence_length)
        cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        with torch.no_grad():
            ref = self._errors(self.reference, x_t, sigma, cond, x0, eps)
        err = self._errors(self.bundle.denoiser, x_t, sigma, cond, x0, eps)
        per_pair, inside = diffusion_dpo_loss(err[:n], err[n:], ref[:n], ref[n:], cfg.beta)
        inside = inside.detach()
        return per_pair.mean(), {
            "implicit_acc": float((inside > 0).float().mean()),
            "margin": float(inside.mean()),
        }

    def _scale(self) -> int:
        """Pixels per latent cell along a side (1 for a pixel-space bundle)."""
        info = self.bundle.model_info()
        return 1 if info["pixel_space"] else info["vae_scale_factor"]

    def export(self, path: str, dtype: torch.dtype = torch.float16) -> None:
        """`export_bundle` of the trained bundle."""
        export_bundle(self.bundle, path, dtype)
