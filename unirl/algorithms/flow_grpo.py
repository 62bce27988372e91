"""Flow-GRPO: PPO-clipped policy gradient on per-step SDE log-prob ratios.

Per SDE step t of sample i, with r = exp(logp_new - logp_old) and the advantage clipped to
A = clip(A_i, -adv_clip_max, adv_clip_max) (flow_grpo's `adv_clip_max`, 5):
    L = mean_{i,t} max(-A*r, -A*clip(r, 1-eps, 1+eps))
plus, when beta > 0, beta * mean_{i,t} KL_t with the Flow-GRPO estimate
    KL_t = mean_{non-batch}((mu_new - mu_ref)^2) / (2 * std_dev_t^2)
(the reference policy is the model with LoRA disabled; std_dev_t is the SDE's
sigma_t, flow_grpo's convention). beta is fixed or adaptive (`kl_target`,
`unirl.algorithms.kl_control`).

`StepLossConfig` and `FlowGRPO` also carry what the diffusion step losses share
(DDPO, DPOK, Flow-DPPO): the pi_old source, the replay over SDE-step chunks, the
KL-to-reference term with its controller, and the metrics; a variant overrides
`policy_loss` (and `kl_scale` for the exact Gaussian KL).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from unirl.algorithms.base import OldLogpSource, StageAlgorithm
from unirl.algorithms.kl_control import (
    KLController,
    KLSpace,
    mean_over_ranks,
    reference_means,
    step_kl,
    transition_std,
    velocity_scale,
)
from unirl.models.stage import DiffusionStage, GraphKeeper, module_device
from unirl.types.constraints import Positive, check_fields
from unirl.types.rollout_resp import RolloutTrack

ClipSchedule = Literal["constant", "linear", "cosine"]
GUARD_OLD_MEANS_KEY = "guard/old_means"


@dataclass
class StepLossConfig:
    """Settings every diffusion step loss shares.

    Attributes:
        old_logp_source: "rollout" uses the log-probs recorded at sampling
            time; "replay" recomputes pi_old at the training geometry before
            the first update (the ratio is then exactly 1 on that update).
        beta: KL coefficient to the reference policy (0 disables it and the
            reference forward); the initial value when adaptive.
        kl_target: null keeps beta fixed; a value makes it adaptive (Ziegler et
            al.'s controller steers the rollout's mean reference KL per step to it).
        kl_horizon: the adaptive controller's horizon in samples.
        kl_space: "latent" (the KL of the SDE steps, on their means: the loss's own scale,
            `kl_scale`) or "velocity" (`mean((v - v_ref)^2)` per step, the velocities the
            means are affine in, `kl_control.velocity_scale`).
    """

    old_logp_source: OldLogpSource = "rollout"
    beta: float = 0.0
    kl_target: float | None = None
    kl_horizon: int = 10000
    kl_space: KLSpace = "latent"

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")
        self.kl_controller()  # range-checks beta, kl_target and kl_horizon

    def kl_controller(self) -> KLController:
        return KLController(self.beta, self.kl_target, self.kl_horizon)


@dataclass
class FlowGRPOConfig(StepLossConfig):
    """Flow-GRPO loss settings (and `StepLossConfig`'s).

    Attributes:
        clip_range: PPO clip epsilon at the start of training.
        clip_range_final: epsilon at the end (linear / cosine schedule);
            None keeps `clip_range`.
        clip_schedule: "constant", "linear" or "cosine" in training progress.
        guard: GRPO-Guard (`guard_log_ratio`): the per-step log-ratio is re-centred and
            rescaled to one scale for every step, and each step's loss is divided by |dt|;
            needs mu_old, replayed under the sampling weights before the first update.
            false: Flow-GRPO's loss, bit for bit.
        adv_clip_max: advantages enter the loss clipped to [-adv_clip_max, adv_clip_max]
            (flow_grpo's, DanceGRPO's, MixGRPO's and DDPO's 5); null leaves them as they are.
    """

    clip_range: Positive = 1e-4
    clip_range_final: Positive | None = None
    clip_schedule: ClipSchedule = "constant"
    guard: bool = False
    adv_clip_max: Positive | None = 5.0

    def clip_at(self, progress: float) -> float:
        """Clip epsilon at training progress in [0, 1]."""
        end = self.clip_range if self.clip_range_final is None else self.clip_range_final
        p = min(max(progress, 0.0), 1.0)
        if self.clip_schedule == "constant":
            return self.clip_range
        if self.clip_schedule == "linear":
            return self.clip_range + (end - self.clip_range) * p
        return end + (self.clip_range - end) * 0.5 * (1 + math.cos(math.pi * p))


def guard_log_ratio(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    means: torch.Tensor,
    old_means: torch.Tensor,
    std: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO-Guard's normalised log-ratio (RatioNorm) and its bias term, [B, k] each.

    With s_t the step's transition std (`std` [k]) and means / old_means [B, k, C, h, w],
        b_t = mean((mu - mu_old)^2) / (2 s_t^2),    z_t = (logp_new - logp_old + b_t) * s_t.
    For x' = mu_old + s_t eps (pi_old sampled the step) the log-ratio is
    -b_t - mean(eps (mu - mu_old)) / s_t: biased negative by b_t and spread as 1/s_t, so one clip
    range acts unevenly over steps. z_t = -mean(eps (mu - mu_old)) has mean 0 and std
    sqrt(mean((mu - mu_old)^2) / n) (n latent elements), whatever s_t.
    """
    bias = step_kl(means, old_means, std)
    return (new_logp - old_logp + bias) * std.unsqueeze(0), bias


def clipped_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise PPO loss max(-A r, -A clip(r)) and the ratio r; shapes [B, k], adv [B] (one
    advantage per sample) or [B, k] (per step: Flow-PPO's GAE)."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
    return loss, ratio


@dataclass
class StepChunk:
    """SDE steps replayed in one forward under the current weights.

    Attributes:
        steps: step indices; cols: their columns in `segment.sde_indices`.
        new_logp, old_logp: [B, k] fp32 log-probs (current weights, pi_old).
        means: [B, k, C, h, w] fp32 step means under the current weights.
        std_dev_t: [k] fp32, the SDE's sigma_t of each step (as replay returns it).
        transition_std: [k] fp32, each step's transition std (`kl_control.transition_std`).
    """

    steps: list[int]
    cols: list[int]
    new_logp: torch.Tensor
    old_logp: torch.Tensor
    means: torch.Tensor
    std_dev_t: torch.Tensor
    transition_std: torch.Tensor


class FlowGRPO(StageAlgorithm):
    """Flow-GRPO on a diffusion track (`LatentSegment` with SDE log-probs).

    The driver of the diffusion step losses: `compute_loss_and_backward` replays
    the SDE steps in chunks (`stage.replay_chunks`), asks `policy_loss` for the
    per-step loss, adds `coef * mean KL_t` to the reference when the coefficient
    is > 0, and backpropagates each chunk's share. `kl_scale` picks the KL's
    scale; `end_of_rollout` steps the adaptive coefficient.
    """

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    requires_sde_logprobs: ClassVar[bool] = True
    supports_kept_graph: ClassVar[bool] = True
    frozen_keys: ClassVar[tuple[str, ...]] = (GUARD_OLD_MEANS_KEY,)
    """`track.conditions` entries `prepare_segment` adds (kept out of the replay's conditions)."""
    adv_clipped_key: ClassVar[str] = "adv_clipped_frac"
    """The metric of the share of advantages the clip changed (`FlowGRPOConfig.adv_clip_max`)."""

    Config: ClassVar[type] = FlowGRPOConfig

    def __init__(self, config: StepLossConfig | None = None) -> None:
        super().__init__(config)
        self.kl = self.config.kl_controller()

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.beta > 0

    def replay_conditions(self, track: RolloutTrack) -> dict[str, torch.Tensor]:
        """The stage's per-sample conditions, without what `prepare_segment` froze there."""
        return {k: v for k, v in track.conditions.items() if k not in self.frozen_keys}

    def check_sde_steps(self, track: RolloutTrack) -> None:
        if not track.segment.sde_indices:
            raise ValueError(
                f"track {track.name!r} has no SDE steps (sampling.eta=0?): {type(self).__name__} needs "
                "log-probs; set sampling.eta > 0"
            )

    @torch.no_grad()
    def prepare_segment(
        self, stage: DiffusionStage, track: RolloutTrack, kept: GraphKeeper | None = None
    ) -> RolloutTrack:
        """With `old_logp_source: replay`, pi_old is recomputed under the current weights;
        a chunk whose graphs were kept at sampling takes their value instead (the same
        weights and inputs at the geometry its loss will use, so the ratio is exactly 1).
        With `guard`, the step means mu_old are frozen the same way (`GUARD_OLD_MEANS_KEY`)."""
        self.check_sde_steps(track)
        guard = getattr(self.config, "guard", False)
        if self.config.old_logp_source == "rollout" and not guard:
            return track
        seg = track.segment
        cond = self.replay_conditions(track)
        logps, means = [], []
        for steps in stage.replay_chunks(seg.sde_indices, seg):
            found = kept.lookup(track.sample_ids, steps) if kept is not None else None
            logp, mean, _ = found if found is not None else stage.replay(seg, cond, steps)
            logps.append(logp)
            means.append(mean)
        if self.config.old_logp_source == "replay":
            seg = dataclasses.replace(seg, log_probs=torch.cat(logps, dim=1))
        conditions = track.conditions
        if guard:
            conditions = {**conditions, GUARD_OLD_MEANS_KEY: torch.cat(means, dim=1)}
        return dataclasses.replace(track, segment=seg, conditions=conditions)

    def policy_loss(
        self, chunk: StepChunk, track: RolloutTrack, adv: torch.Tensor, ctx: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-step policy loss [B, k], the ratios [B, k] and loss-specific float metrics
        (averaged over chunks, weighted by their step counts); adv [B], or [B, k] the chunk's
        columns of per-step advantages (Flow-PPO). The advantage enters both PPO terms clipped
        to `adv_clip_max`, as in flow_grpo's training loop."""
        clip = self.config.clip_at(ctx["progress"])
        adv, metrics = self.clip_advantages(adv)
        metrics["clip_range"] = clip
        if not getattr(self.config, "guard", False):
            loss, ratio = clipped_policy_loss(chunk.new_logp, chunk.old_logp, adv, clip)
            metrics["clipfrac"] = float(((ratio.detach() - 1).abs() > clip).float().mean())
            return loss, ratio, metrics
        if GUARD_OLD_MEANS_KEY not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")
        old_means = track.conditions[GUARD_OLD_MEANS_KEY][:, chunk.cols]
        std = chunk.transition_std.to(chunk.means.device)
        z, bias = guard_log_ratio(chunk.new_logp, chunk.old_logp, chunk.means, old_means, std)
        ratio = torch.exp(z)
        a = adv.unsqueeze(1) if adv.dim() == 1 else adv
        sig = track.segment.sigmas.to(torch.float32)
        dt = torch.stack([sig[i + 1] - sig[i] for i in chunk.steps]).to(z.device)
        loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip)) / (-dt).unsqueeze(0)
        metrics["clipfrac"] = float(((ratio.detach() - 1).abs() > clip).float().mean())
        metrics["guard/bias"] = float(bias.detach().mean())
        return loss, ratio, metrics

    def clip_advantages(self, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """adv ([B] or [B, k]) clamped to [-adv_clip_max, adv_clip_max] and {`adv_clipped_key`:
        the share of entries the clamp changed}; with `adv_clip_max` null, adv as is and {}."""
        c = self.config.adv_clip_max
        if c is None:
            return adv, {}
        return adv.clamp(-c, c), {self.adv_clipped_key: float((adv.abs() > c).float().mean())}

    def kl_scale(self, chunk: StepChunk) -> torch.Tensor:
        """[k] the scale s of KL_t = mean((mu - mu_ref)^2) / (2 s^2): flow_grpo's std_dev_t."""
        return chunk.std_dev_t

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale` (float), `progress` (float in [0, 1]), `reference`
        (a context-manager factory that switches the module to the reference policy);
        with `rollout.keep_graph`, `kept` and `deferred` (see `TrainStack.train_track`):
        a chunk whose (sample, step) pairs are all kept takes its log-probs and means from
        the sampling graphs, and its loss goes to `deferred` instead of backward."""
        seg = track.segment
        if track.advantages is None:
            raise ValueError(f"track {track.name!r} has no advantages: compute them before training")
        coef = self.kl.value
        cond = self.replay_conditions(track)
        k_total = len(seg.sde_indices)
        sums: dict[str, float] = {}
        rmin, rmax = math.inf, -math.inf
        kept = ctx.get("kept")

        def add(key: str, value: float, w: int) -> None:
            sums[key] = sums.get(key, 0.0) + value * w

        for steps in stage.replay_chunks(seg.sde_indices, seg):
            cols = [seg.sde_indices.index(i) for i in steps]
            if coef > 0:  # before the policy forward: a full fine-tune's reference swaps weights in place
                ref_means = reference_means(stage, seg, cond, steps, ctx["reference"])
            found = kept.lookup(track.sample_ids, steps) if kept is not None else None
            new_logp, means, std_dev_t = found if found is not None else stage.replay(seg, cond, steps)
            std = transition_std(stage, seg, steps).to(std_dev_t.device)
            chunk = StepChunk(steps, cols, new_logp, seg.log_probs[:, cols], means, std_dev_t, std)
            adv = track.advantages if track.advantages.dim() == 1 else track.advantages[:, cols]
            per_elem, ratio, extra = self.policy_loss(chunk, track, adv, ctx)
            policy = per_elem.mean()
            loss = policy
            w = len(steps)
            if coef > 0:
                if self.config.kl_space == "latent":
                    scale = self.kl_scale(chunk)
                else:  # step_kl over c_t^2 / 2 is mean((v - v_ref)^2)
                    scale = velocity_scale(stage, seg, steps).to(std_dev_t.device).abs() / math.sqrt(2)
                kl = step_kl(means, ref_means, scale)
                loss = loss + coef * kl.mean()
                add("kl", float(kl.detach().mean()), w)
            scaled = loss * ctx["loss_scale"] * w / k_total
            if found is None:
                scaled.backward()
            else:
                ctx["deferred"].append(scaled)
            if kept is not None:
                add("keep_graph/kept_fraction", float(found is not None), w)
            ratio, diff = ratio.detach(), new_logp.detach() - chunk.old_logp
            add("loss", float(loss.detach()), w)
            add("policy_loss", float(policy.detach()), w)
            add("approx_kl", float(0.5 * (diff**2).mean()), w)
            add("ratio/mean", float(ratio.mean()), w)
            for key, value in extra.items():
                add(key, value, w)
            rmin, rmax = min(rmin, float(ratio.min())), max(rmax, float(ratio.max()))
        out = {key: value / k_total for key, value in sums.items()}
        out.update({"ratio/min": rmin, "ratio/max": rmax})
        if coef > 0:
            out["kl/coef"] = coef
        return out

    def end_of_rollout(
        self, stage: DiffusionStage, metrics: dict[str, float], num_samples: int
    ) -> dict[str, float]:
        """Step an adaptive KL coefficient on the rollout's mean reference KL over all ranks."""
        if not (self.kl.adaptive and self.kl.value > 0):
            return {}
        kl = mean_over_ranks(metrics["kl"], module_device(stage.module))
        return {"kl/coef_next": self.kl.update(kl, num_samples)}

    def state_dict(self) -> dict[str, Any]:
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kl" in state:
            self.kl.load_state_dict(state["kl"])
