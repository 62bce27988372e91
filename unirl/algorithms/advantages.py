"""Reward -> advantage estimators, and the per-token KL estimators they share with the text losses.

One implementation serves every trainer: the drivers call `track_advantages` on a scored track
(PPO's critic `track_value_targets`), and `unirl.algorithms.token_losses` re-exports
`kl_penalty`. What the estimators accept is `unirl.types.AdvantageConfig`.
"""

from __future__ import annotations

import torch

from unirl.types.advantages import KL_ESTIMATORS, AdvantageConfig
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment, TokenSegment

KL_INPUT_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs; same shape as the inputs.

    With d = logp - ref_logp (tokens drawn from pi):
        k1: d                                   (unbiased, can be negative)
        k2: 0.5 * d^2
        k3 / low_var_kl: exp(-d') + d' - 1 with d' = clamp(d, -20, 20), the value
            clamped to [-10, 10] (non-negative, low variance; verl's clamps).
    Differentiable in both arguments; callers detach the reference.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    neg = torch.clamp(-d, -KL_INPUT_CLAMP, KL_INPUT_CLAMP)
    return torch.clamp(torch.exp(neg) - neg - 1, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def group_layout(group_ids: list[str]) -> tuple[int, int]:
    """(num_groups, group_size) of contiguous, uniform groups; raise otherwise."""
    if not group_ids:
        raise ValueError("cannot compute advantages of an empty batch")
    runs: list[tuple[str, int]] = []
    for gid in group_ids:
        if runs and runs[-1][0] == gid:
            runs[-1] = (gid, runs[-1][1] + 1)
        else:
            runs.append((gid, 1))
    seen = [g for g, _ in runs]
    if len(set(seen)) != len(seen):
        dup = next(g for g in seen if seen.count(g) > 1)
        raise ValueError(
            f"group {dup!r} is not contiguous: siblings of a prompt must be adjacent in the batch "
            "(build requests with RolloutReq.from_prompts and keep sample order)"
        )
    sizes = {n for _, n in runs}
    if len(sizes) != 1:
        raise ValueError(
            f"groups must all have the same size, got sizes {sorted(sizes)} for {len(runs)} groups"
        )
    return len(runs), sizes.pop()


def _grouped_shifted(r: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """[G, n] float64 rewards minus their group's first value: means and stds are unchanged, and an
    all-equal group becomes exactly 0 whatever the value (0.7, a weighted sum of components)."""
    num_groups, size = group_layout(group_ids)
    g = r.view(num_groups, size)
    return g - g[:, :1]


def _grpo(r: torch.Tensor, group_ids: list[str], cfg: AdvantageConfig) -> torch.Tensor:
    if cfg.scope == "global":
        d = r - r[0]
        centered = d - d.mean()
        return centered / (d.std(unbiased=False) + cfg.eps) if cfg.norm_by_std else centered
    d = _grouped_shifted(r, group_ids)
    centered = d - d.mean(dim=1, keepdim=True)
    if cfg.norm_by_std:
        std = (r - r[0]).std(unbiased=False) if cfg.global_std else d.std(dim=1, unbiased=False, keepdim=True)
        centered = centered / (std + cfg.eps)
    return centered.reshape(-1)


def _rloo(r: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    d = _grouped_shifted(r, group_ids)
    n = d.shape[1]
    if n < 2:
        raise ValueError(
            "advantage.estimator=rloo compares each sample with its siblings: it needs groups of >= 2 "
            "samples (sampling.samples_per_prompt >= 2), got groups of 1"
        )
    others = (d.sum(dim=1, keepdim=True) - d) / (n - 1)
    return (d - others).reshape(-1)


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float, center: bool) -> torch.Tensor:
    """x [B, R] float64 over the valid tokens of the batch: (x - mean) / (std + eps), or x / (std + eps)
    without `center`; population std; 0 on padding. Shifted by the first valid value first, so a batch
    of equal values centres to exactly 0."""
    valid = mask.bool()
    vals = x[valid]
    std = (vals - vals[0]).std(unbiased=False)
    if center:
        shifted = x - vals[0]
        x = shifted - shifted[valid].mean()
    return torch.where(valid, x / (std + eps), torch.zeros_like(x))


def _token_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) R_k per row of [B, R] (R is 0 on right padding)."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = token_rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation per row of right-padded [B, R] tensors.

        delta_t = R_t + gamma V_{t+1} - V_t   (V_{t+1} = 0 past the last response token)
        A_t = delta_t + gamma lam A_{t+1},  returns_t = A_t + V_t

    `values` V_t is the value of the state before response token t; padding (mask 0) is
    ignored and comes back 0. Returns (advantages, returns), not whitened.
    """
    v = values * mask
    adv = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        next_v = v[:, t + 1] if t + 1 < v.shape[1] else torch.zeros_like(running)
        delta = token_rewards[:, t] + gamma * next_v - v[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + v) * mask


def _token_rewards(r: torch.Tensor, m: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """[B, R]: -kl_coef kl_t on every response token, plus the sample's reward on its last one."""
    token_rewards = -kl_coef * kl if kl is not None else torch.zeros_like(m)
    last = m.sum(dim=1).long() - 1
    token_rewards[torch.arange(r.numel(), device=r.device), last] += r
    return token_rewards


def value_targets(
    rewards: torch.Tensor,
    cfg: AdvantageConfig,
    *,
    mask: torch.Tensor,
    values: torch.Tensor,
    token_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Rmax] fp32 GAE returns (the critic's regression targets): `gae`'s returns on the token
    rewards `compute_advantages` uses for estimator gae. Rows are independent, so a micro-batch's
    targets equal its rows of the batch's."""
    m = mask.detach().to(torch.float64)
    r = rewards.detach().to(device=m.device, dtype=torch.float64)
    kl = None if token_kl is None or cfg.kl_coef == 0 else token_kl.detach().to(m) * m
    tr = _token_rewards(r, m, kl, cfg.kl_coef)
    return gae(tr, values.detach().to(m), m, cfg.gamma, cfg.lam)[1].to(torch.float32)


def _gdpo(
    group_ids: list[str],
    cfg: AdvantageConfig,
    components: dict[str, torch.Tensor] | None,
    weights: dict[str, float] | None,
) -> torch.Tensor:
    """GDPO: the weighted sum of the components' group z-scores, normalised over the batch."""
    if not components or not weights or set(components) != set(weights):
        raise ValueError(
            "advantage.multi_reward=gdpo normalises each reward component on its own: it needs the "
            f"track's reward components and their weights, got components {sorted(components or {})} "
            f"and weights {sorted(weights or {})}"
        )
    total = None
    for name, weight in weights.items():
        scores = components[name].detach().to(torch.float64)
        if scores.dim() != 1 or scores.numel() != len(group_ids):
            raise ValueError(f"reward component {name!r} must be [B={len(group_ids)}], got {list(scores.shape)}")
        part = weight * _grpo(scores, group_ids, cfg)
        total = part if total is None else total + part
    d = total - total[0]
    return (d - d.mean()) / (d.std(unbiased=False) + cfg.eps)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: list[str],
    cfg: AdvantageConfig,
    *,
    mask: torch.Tensor | None = None,
    token_kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    components: dict[str, torch.Tensor] | None = None,
    weights: dict[str, float] | None = None,
) -> torch.Tensor:
    """fp32 advantages from [B] rewards: [B] for grpo / rloo, [B, Rmax] (0 on padding) for reinforce_pp*.

    Args:
        rewards: [B] scores, one per response.
        group_ids: per sample; siblings contiguous, groups of one size (grpo scope group, rloo,
            reinforce_pp_baseline).
        mask: [B, Rmax] 1 on response tokens, 0 on right padding; needed when `cfg.needs_tokens`.
        token_kl: [B, Rmax] per-token KL to the reference (`kl_penalty`); needed when `cfg.kl_coef > 0`.
        values: [B, Rmax] the critic's per-token values (estimator gae).
        components, weights: multi_reward gdpo: the [B] unweighted reward components and their
            weights (`rewards` is then their weighted sum, and not read).

    Estimators, with r the rewards (minus `kl_coef * sum_t kl_t` when KL is folded in):
        grpo: group scope A = (r - mean_g) / (std_g + eps), std_g the population std of the group
            (of the batch with `global_std`); global scope over the batch; `norm_by_std: false`
            drops the division (Dr.GRPO).
        rloo: A_i = r_i - mean_{j != i} r_j over the siblings (= n/(n-1) (r_i - mean_g)).
        reinforce_pp: token rewards R_t = -kl_coef kl_t, plus r_i at the last response token;
            returns G_t = sum_{k >= t} gamma^(k-t) R_k; whitened over the valid tokens of the batch.
        reinforce_pp_baseline: (r_i - mean_g) broadcast to the response tokens, divided by the
            population std over the valid tokens of the batch (not re-centred, so a group of equal
            rewards keeps exactly 0; verl's masked_whiten also subtracts the token mean).
        gae: token rewards as reinforce_pp's; `gae` advantages on `values` (gamma, lam), whitened
            over the valid tokens of the batch (population std + eps; verl: rsqrt(unbiased var + 1e-8)).
        gdpo (multi_reward): S = sum_k w_k grpo(c_k), each component's group z-score; then
            A = (S - mean S) / (std S + eps) over the batch.
    Then optional clipping. Computed in float64 on values shifted by their group's first value
    (grpo, rloo, baseline) or the batch's first (global scope, reinforce_pp), so a group (batch) of
    equal rewards gets exactly zero advantage instead of a rounding residue divided by `eps`.
    """
    if rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards must be [B] with B = len(group_ids) = {len(group_ids)}, got {list(rewards.shape)}"
        )
    if not group_ids:
        raise ValueError("cannot compute advantages of an empty batch")
    if cfg.multi_reward == "gdpo":
        adv = _gdpo(group_ids, cfg, components, weights)
        return (adv.clamp(-cfg.clip, cfg.clip) if cfg.clip is not None else adv).to(torch.float32)
    r = rewards.detach().to(torch.float64)
    m = kl = None
    if cfg.needs_tokens:
        if mask is None or mask.dim() != 2 or mask.shape[0] != r.numel():
            got = None if mask is None else list(mask.shape)
            raise ValueError(
                f"advantage.estimator={cfg.estimator!r} with advantage.kl_coef={cfg.kl_coef} needs the "
                f"[B, Rmax] response mask (a text track), got {got}"
            )
        m = mask.detach().to(device=r.device, dtype=torch.float64)
    if cfg.kl_coef > 0:
        if token_kl is None or m is None or token_kl.shape != m.shape:
            got = None if token_kl is None else list(token_kl.shape)
            raise ValueError(
                f"advantage.kl_coef={cfg.kl_coef} folds the KL into the reward: pass token_kl of the "
                f"mask's shape {list(m.shape)}, got {got}"
            )
        kl = token_kl.detach().to(device=r.device, dtype=torch.float64) * m
    if cfg.estimator == "reinforce_pp":
        token_rewards = _token_rewards(r, m, kl, cfg.kl_coef)
        adv = _whiten(_token_returns(token_rewards, cfg.gamma), m, cfg.eps, center=True)
    elif cfg.estimator == "gae":
        if values is None or values.shape != m.shape:
            got = None if values is None else list(values.shape)
            raise ValueError(
                f"advantage.estimator=gae needs the critic's [B, Rmax] values {list(m.shape)}, got {got}: "
                "set critic in the recipe"
            )
        token_rewards = _token_rewards(r, m, kl, cfg.kl_coef)
        adv, _ = gae(token_rewards, values.detach().to(m), m, cfg.gamma, cfg.lam)
        adv = _whiten(adv, m, cfg.eps, center=True)
    else:
        if kl is not None:
            r = r - cfg.kl_coef * kl.sum(dim=1)
        if cfg.estimator == "grpo":
            adv = _grpo(r, group_ids, cfg)
        elif cfg.estimator == "rloo":
            adv = _rloo(r, group_ids)
        else:
            d = _grouped_shifted(r, group_ids)
            centered = (d - d.mean(dim=1, keepdim=True)).reshape(-1)
            adv = _whiten(centered[:, None] * m, m, cfg.eps, center=False)
    if cfg.clip is not None:
        adv = adv.clamp(-cfg.clip, cfg.clip)
    return adv.to(torch.float32)


def track_advantages(track: RolloutTrack, cfg: AdvantageConfig) -> torch.Tensor:
    """Set and return `track.advantages` from its `rewards` (see `compute_advantages`). When `cfg`
    needs tokens (reinforce_pp*, or KL folded into the reward) the response mask and the
    per-token KL (rollout `log_probs` vs `ref_log_probs`) come from the `TokenSegment`."""
    if track.rewards is None:
        raise ValueError(f"track {track.name!r} has no rewards: score it before computing advantages")
    parts = {}
    if cfg.multi_reward == "gdpo":  # each component normalised on its own
        parts = {"components": track.reward_components, "weights": track.reward_weights}
    track.advantages = compute_advantages(track.rewards, track.group_ids, cfg, **token_inputs(track, cfg), **parts)
    return track.advantages

def track_value_targets(track: RolloutTrack, cfg: AdvantageConfig) -> torch.Tensor:
    """[B, Rmax] GAE returns of `track` (`value_targets`): the critic's regression targets,
    from `rewards` and the segment's `values` under `cfg` (estimator gae)."""
    if track.rewards is None:
        raise ValueError(f"track {track.name!r} has no rewards: score it before computing returns")
    return value_targets(track.rewards, cfg, **token_inputs(track, cfg))

def token_inputs(track: RolloutTrack, cfg: AdvantageConfig) -> dict[str, torch.Tensor]:
    """`mask` ([B, Rmax]), with `cfg.kl_coef > 0` `token_kl` ([B, Rmax], `cfg.kl_estimator`
    of the rollout log-probs against the reference's) and with estimator gae `values` (the
    critic's, [B, Rmax]) for `compute_advantages`; {} when `cfg` needs none of them. A
    diffusion track with estimator gae gives `step_inputs()`: its SDE steps are the tokens."""
    if not cfg.needs_tokens:
        return {}
    seg = track.segment
    if isinstance(seg, LatentSegment) and cfg.estimator == "gae" and cfg.kl_coef == 0:
        return step_inputs(track)
    if not isinstance(seg, TokenSegment):
        raise ValueError(
            f"advantage.estimator={cfg.estimator!r} with advantage.kl_coef={cfg.kl_coef} needs "
            f"per-token data, but track {track.name!r} holds a {type(seg).__name__}; use estimator "
            "grpo or rloo with kl_coef 0 on it"
        )
    out = {"mask": seg.response_mask()}
    if cfg.kl_coef > 0:
        if seg.ref_log_probs is None:
            raise ValueError(
                f"advantage.kl_coef={cfg.kl_coef} folds the KL into the reward, but track {track.name!r} "
                "has no ref_log_probs: the rollout must record the reference policy's log-probs"
            )
        logp, ref = seg.padded("log_probs").float(), seg.padded("ref_log_probs").float()
        out["token_kl"] = kl_penalty(logp, ref, cfg.kl_estimator) * out["mask"]
    if cfg.estimator == "gae":
        if seg.values is None:
            raise ValueError(
                f"advantage.estimator=gae needs per-token values, but track {track.name!r} has none: "
                "the recipe's critic records them at rollout (set critic)"
            )
        out["values"] = seg.padded("values").float()
    return out

def step_inputs(track: RolloutTrack) -> dict[str, torch.Tensor]:
    """GAE's inputs over a diffusion track's K SDE steps: `mask` [B, K] of ones (every sample
    takes every step) and `values` [B, K] (the critic's, `LatentSegment.values`). The reward
    then sits on the last step, as a text response's on its last token."""
    values = getattr(track.segment, "values", None)
    if values is None:
        raise ValueError(
            f"advantage.estimator=gae needs per-step values, but track {track.name!r} has none: "
            "the recipe's critic records them at rollout (set critic)"
        )
    values = values.float()
    return {"mask": torch.ones_like(values), "values": values}
