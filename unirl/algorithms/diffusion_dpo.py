"""Diffusion-DPO (Wallace et al., 2023) on flow-matching errors, with pairs from group rollouts.

A preference pair (x_w preferred to x_l, one prompt) is noised with one shared draw
(t, eps): x_t = (1 - t) x0 + t eps. With the flow-matching target v = eps - x0 and the
per-sample error err(x) = mean_{non-batch}((v_theta(x_t, t) - v)^2) of the trained
model and err_ref of the frozen reference (LoRA disabled, or the initial weights):
    inside = -beta / 2 * ((err_w - err_ref_w) - (err_l - err_ref_l))
    L      = mean_{pairs, draws} -log sigmoid(inside)
Lowering the chosen sample's error relative to the reference, and raising the
rejected one's, lowers the loss. beta absorbs Wallace et al.'s T * w(t) and the mean
over elements (their SD1.5 code: 5000 with mean errors; they report 2500-5000).

Pairs come from the rollout's groups (`preference_pairs`): per prompt group the
highest-reward sample is chosen and the lowest rejected (the first one on ties); a
group whose rewards are all equal says nothing and is skipped. Groups travel whole in
a micro-batch (`compares_within_groups`: validation requires micro_batch_size to be a
multiple of samples_per_prompt, and samples_per_prompt >= 2). The loss uses only the
final latents, so rollouts may be ODE samples (`sampling.eta: 0`). Draws of (t, eps)
are seeded by the pair's group id: batching and resume do not change them.
Offline pairs from a file are a supervised track's groups (`DemonstrationEngine` with
`target_key: [chosen, rejected]`, recipe `diffusion/shapes_diffusiondpo_offline`; same loss).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from unirl.algorithms.base import StageAlgorithm
from unirl.models.stage import DiffusionStage
from unirl.types.constraints import AtLeastOne, Positive, check_fields
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class DiffusionDPOConfig:
    """Diffusion-DPO settings.

    Attributes:
        beta: the DPO inverse temperature on mean-reduced flow-matching errors (> 0).
        draws_per_pair: (t, eps) draws per pair and update; each costs a forward of
            both samples under the policy and the reference.
        seed: with the group id, seeds every draw.
    """

    beta: Positive = 2000.0
    draws_per_pair: AtLeastOne = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")


def preference_pairs(rewards: torch.Tensor, group_ids: list[str]) -> tuple[list[int], list[int], int]:
    """Best vs worst by reward within each prompt group.

    Returns (chosen indices, rejected indices, groups skipped): one pair per group
    whose rewards are not all equal, in the order groups first appear; on a tie for
    best or worst the earliest sample is taken. Raises ValueError naming a group of
    one sample (there is nothing to compare it with)."""
    members: dict[str, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    chosen, rejected, skipped = [], [], 0
    values = rewards.detach().double().cpu().tolist()
    for gid, idx in members.items():
        if len(idx) < 2:
            raise ValueError(
                f"Diffusion-DPO pairs the best and worst sample of a prompt group, but group {gid!r} has "
                f"{len(idx)} sample in this micro-batch: set sampling.samples_per_prompt >= 2 and "
                "train.stack.micro_batch_size to a multiple of it"
            )
        r = [values[i] for i in idx]
        best, worst = max(r), min(r)
        if best == worst:
            skipped += 1
            continue
        chosen.append(idx[r.index(best)])
        rejected.append(idx[r.index(worst)])
    return chosen, rejected, skipped


def flow_matching_error(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[N] mean over non-batch dims of (v_pred - (noise - x0))^2, in fp32."""
    err = (v_pred.float() - (noise.float() - x0.float())) ** 2
    return err.mean(dim=tuple(range(1, err.dim())))


def diffusion_dpo_loss(
    err_w: torch.Tensor, err_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss -log sigmoid(inside) and inside = -beta/2 ((err_w - ref_w) - (err_l - ref_l)); all [P]."""
    inside = -0.5 * beta * ((err_w - ref_w) - (err_l - ref_l))
    return -F.logsigmoid(inside), inside


class DiffusionDPO(StageAlgorithm):
    """Diffusion-DPO on a diffusion track: pairs from each group's rewards, final latents only."""

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    compares_within_groups: ClassVar[bool] = True

    Config: ClassVar[type] = DiffusionDPOConfig

    @property
    def needs_reference_policy(self) -> bool:
        return True

    def draws(self, track: RolloutTrack, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma [P, k], noise [P, k, C, h, w]) for the pairs whose chosen rows are `rows`,
        from the rollout's sigmas sigmas[0..T-1], seeded by the group id."""
        seg = track.segment
        k = self.config.draws_per_pair
        sigmas, noises = [], []
        for i in rows:
            gen = torch.Generator().manual_seed(
                zlib.crc32(f"{self.config.seed}:{track.group_ids[i]}".encode())
            )
            idx = torch.randint(0, seg.num_steps, (k,), generator=gen)
            sigmas.append(seg.sigmas.cpu()[idx])
            noises.append(torch.randn((k, *seg.final.shape[1:]), generator=gen))
        return torch.stack(sigmas), torch.stack(noises)

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale` (float), `reference` (context-manager factory switching to the
        reference policy). Needs `track.rewards` and whole groups."""
        cfg = self.config
        if track.rewards is None:
            raise ValueError(f"track {track.name!r} has no rewards: score it before training")
        chosen, rejected, skipped = preference_pairs(track.rewards, track.group_ids)
        weight = 1.0
        if not chosen:  # every group tied: a zero-weight pass keeps every rank's backward in step
            chosen, rejected, weight = [0], [0], 0.0
        k = cfg.draws_per_pair
        x0 = track.segment.final.float()
        device = x0.device
        sigma, noise = self.draws(track, chosen)
        sigma, noise = sigma.reshape(-1).to(device), noise.flatten(0, 1).to(device)
        rows = [i for i in chosen for _ in range(k)] + [i for i in rejected for _ in range(k)]
        idx = torch.tensor(rows, device=device)
        x0_rows = x0[idx]
        eps = torch.cat([noise, noise])  # one draw shared by the two samples of a pair
        t = torch.cat([sigma, sigma])
        s = t.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - s) * x0_rows + s * eps
        cond = {key: v[idx] for key, v in track.conditions.items()}
        # the reference first: a full fine-tune swaps weights in place
        with torch.no_grad(), ctx["reference"]():
            ref_err = flow_matching_error(stage.velocity(x_t, t, cond, 1.0), x0_rows, eps)
        err = flow_matching_error(stage.velocity(x_t, t, cond, 1.0), x0_rows, eps)
        n = len(chosen) * k
        per_pair, inside = diffusion_dpo_loss(err[:n], err[n:], ref_err[:n], ref_err[n:], cfg.beta)
        loss = per_pair.mean() * weight
        (loss * ctx["loss_scale"]).backward()
        inside, err = inside.detach(), err.detach()
        return {
            "loss": float(loss.detach()),
            "dpo/pairs": float(len(chosen) if weight else 0),
            "dpo/tied_groups": float(skipped),
            "dpo/implicit_acc": float((inside > 0).float().mean()) if weight else 0.0,
            "dpo/margin": float(inside.mean()) * weight,
            "dpo/err_chosen": float(err[:n].mean()),
            "dpo/err_rejected": float(err[n:].mean()),
            "dpo/err_chosen_ref": float(ref_err[:n].mean()),
        }
