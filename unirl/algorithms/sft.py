"""Supervised fine-tuning as a track's loss: `LMSFT` (a causal LM's demonstrations' cross-entropy)
and `FlowSFT` (a flow-matching model's demonstrations' velocity regression, below).

The batch comes from a `unirl.rollout.demonstrations.DemonstrationEngine`: each sample's response
is the demonstration its prompt row carries, teacher-forced. With log p_t the response token's
log-probability at temperature 1 (`stage.token_log_probs`) and m_t its mask,

    L = - sum_{i,t} m_t log p_t / N,   N = the response tokens (EOS included) of the whole batch,

the completion cross-entropy of the (prompt, completion + EOS) pairs
(`unirl.models.causal_lm.loading.encode_pairs`; the tests hold the two equal).
Each micro-batch contributes its share (`aggregate(..., "token-mean", num_tokens)` with the
batch's totals from the train stack), so micro-batching and data parallelism give the batch's loss
exactly. No reward or advantage enters it (`uses_reward = False`); the run then has neither.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
from annotated_types import Ge, Gt, Lt

from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.grpo import text_segment
from unirl.algorithms.token_losses import aggregate
from unirl.models.flow.stage import EMPTY
from unirl.models.stage import TextStage
from unirl.sde.schedules import check_sigma_sampling, sample_sigmas
from unirl.types.constraints import check_fields
from unirl.types.rollout_resp import RolloutTrack


class LMSFT(StageAlgorithm):
    """Token-mean cross-entropy of a text track's demonstrations (see the module docstring).

    `compute_loss_and_backward` reads `loss_scale` and `num_tokens` (the batch's response tokens
    over the world size) from ctx; its `loss` metric is the batch's mean token cross-entropy.
    """

    modality: ClassVar[str] = "text"
    supports_multi_update: ClassVar[bool] = True
    uses_reward: ClassVar[bool] = False
    learns_from_demonstrations: ClassVar[bool] = True

    def compute_loss_and_backward(
        self, stage: TextStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        seg = text_segment(track)
        logp = stage.token_log_probs(seg).float()
        mask = seg.response_mask().to(device=logp.device, dtype=logp.dtype)
        loss = aggregate(-logp, mask, "token-mean", num_tokens=ctx["num_tokens"])
        loss.backward()
        scale = ctx["loss_scale"]  # the stack averages rows over micro-batches: report the batch's share
        return {
            "loss": float(loss.detach()) / scale,
            "response_length/mean": float(mask.sum(dim=1).mean()),
        }


@dataclass
class FlowSFTConfig:
    """Settings of flow-matching SFT on a diffusion track (the run owns steps, batch and
    optimizer).

    Attributes:
        sigma_sampling: "logit_normal" (sigmoid of N(0, 1), SD3's default) or "uniform".
        shift: sigma = shift t / (1 + (shift - 1) t), matching the sampling schedule.
        cond_dropout: probability of training a sample on the empty prompt (classifier-free
            guidance at sampling needs it).
        guidance_scale: the scale an "embedded" family (FLUX.1-dev) is trained at, a network
            input; 1.0 for a family that trains unguided (any other scale is refused there at
            the first step).
        seed: with the sample's id, seeds its noise level, noise and dropout draw, so a sample's
            loss depends on neither its batch-mates nor its rank, and a resumed run draws the same.
    """

    sigma_sampling: str = "logit_normal"
    shift: Annotated[float, Gt(0)] = 1.0
    cond_dropout: Annotated[float, Ge(0), Lt(1)] = 0.1
    guidance_scale: Annotated[float, Gt(0)] = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")
        check_sigma_sampling(self.sigma_sampling, "algorithm.config.sigma_sampling")


class FlowSFT(StageAlgorithm):
    """Flow-matching SFT of a diffusion track's demonstrations (rectified flow, as SD3).

    For demonstration x0 (the track's final latent), noise eps and noise level sigma, x_sigma =
    (1 - sigma) x0 + sigma eps and the denoiser regresses the velocity eps - x0:

        L = mean_i mean_elements (v_theta(x_sigma_i, sigma_i, c_i) - (eps_i - x0_i))^2,

    the flow-matching loss of each sample, averaged over the batch (each
    micro-batch contributes its mean times `loss_scale`). sigma is drawn by `sample_sigmas`; with
    probability `cond_dropout` a sample's conditions are the empty prompt's (`empty_<key>`, which
    the `DemonstrationEngine` puts beside them). Every draw comes from a CPU generator seeded by
    (config.seed, the sample's id). Only the denoiser trains (the track's text encoders are frozen,
    as in every RL track).
    """

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    uses_reward: ClassVar[bool] = False
    learns_from_demonstrations: ClassVar[bool] = True

    Config: ClassVar[type] = FlowSFTConfig

    def draws(
        self, sample_ids: list[str], shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigma [B], eps [B, *shape], dropped [B] bool) on the CPU, one generator per sample."""
        cfg = self.config
        sigmas, noise, dropped = [], [], []
        for sid in sample_ids:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}:{sid}".encode()))
            sigmas.append(sample_sigmas(1, cfg, gen))
            noise.append(torch.randn(shape, generator=gen))
            dropped.append(bool(torch.rand(1, generator=gen) < cfg.cond_dropout))
        return torch.cat(sigmas), torch.stack(noise), torch.tensor(dropped)

    def compute_loss_and_backward(self, stage, track: RolloutTrack, ctx: dict[str, Any]) -> dict[str, float]:
        cfg = self.config
        if getattr(stage.bundle, "guidance", None) != "embedded" and cfg.guidance_scale != 1.0:
            raise ValueError(
                f"algorithm.config.guidance_scale={cfg.guidance_scale}: {type(stage.bundle).__name__} guides by "
                "two branches at sampling, so it trains unguided; set it to 1.0"
            )
        x0 = track.segment.final.float()
        sigma, eps, dropped = self.draws(list(track.sample_ids), tuple(x0.shape[1:]))
        device = x0.device
        sigma, eps = sigma.to(device), eps.to(device)
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        x_t = (1 - s) * x0 + s * eps
        cond = dict(track.conditions)
        if bool(dropped.any()):
            empty = {k[len(EMPTY) :]: v for k, v in cond.items() if k.startswith(EMPTY)}
            if not empty:
                raise ValueError(
                    f"track {track.name!r} carries no empty-prompt conditions, so algorithm.config.cond_dropout="
                    f"{cfg.cond_dropout} cannot drop a prompt; sample it with DemonstrationEngine"
                )
            rows = dropped.to(device)
            for k, v in empty.items():
                cond[k] = torch.where(rows.view(-1, *[1] * (v.dim() - 1)), v, cond[k])
        pred = stage.velocity(x_t, sigma, cond, cfg.guidance_scale)
        per_sample = ((pred.float() - (eps - x0)) ** 2).flatten(1).mean(dim=1)
        scale = ctx["loss_scale"]
        loss = per_sample.mean() * scale
        loss.backward()
        return {
            "loss": float(loss.detach()) / scale,
            "sft/sigma_mean": float(sigma.mean()),
            "sft/dropped_frac": float(dropped.float().mean()),
        }
