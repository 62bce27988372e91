"""A stand-in diffusion stage for loss tests that need no real denoiser: a 1x1 convolution
whose velocity depends on x, sigma and a per-sample condition, sampled and replayed with the
shared SDE strategies exactly as the flow stage does (`unirl/models/flow/stage.py`). A loss
computed through it can be checked against the same formula written out in a test in
milliseconds instead of a tiny SD3's seconds."""

from __future__ import annotations

import contextlib

import torch

from unirl.sde.strategies import gaussian_log_prob, make_strategy
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0])


class LinearStage:
    """v = conv1x1(x) * (1 + sigma) + c, c the per-sample condition `cond["c"]` [B]."""

    def __init__(self, channels: int = 2, sde: str = "flow", seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Conv2d(channels, channels, 1)
        self.sde = sde

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict, guidance_scale: float
    ) -> torch.Tensor:
        return self.module(x) * (1 + sigma.view(-1, 1, 1, 1)) + cond["c"].view(-1, 1, 1, 1)

    def replay(self, segment: LatentSegment, cond: dict, steps: list[int]):
        strategy = make_strategy(self.sde, segment.eta)
        lps, means, stds = [], [], []
        for i in steps:
            x = segment.at(i)
            v = self.velocity(x, segment.sigmas[i].expand(len(x)), cond, segment.guidance_scale)
            out = strategy.step(x, v, segment.sigmas, i, sde=True, next_sample=segment.at(i + 1))
            lps.append(out.log_prob)
            means.append(out.mean)
            stds.append(out.std_dev_t)
        return torch.stack(lps, dim=1), torch.stack(means, dim=1), torch.stack(stds)

    def replay_chunks(self, steps: list[int], segment=None):
        for k in range(0, len(steps), 2):
            yield steps[k : k + 2]

    @contextlib.contextmanager
    def swapped(self, weight: torch.Tensor):
        """The module with another 1x1 weight (a reference or EMA policy), restored after."""
        saved = self.module.weight.data.clone()
        self.module.weight.data.copy_(weight)
        try:
            yield
        finally:
            self.module.weight.data.copy_(saved)


def sampled_track(
    stage: LinearStage, n: int = 4, sde_indices: tuple[int, ...] = (1, 2, 3), eta: float = 0.7, seed: int = 1
) -> RolloutTrack:
    """An SDE rollout of `n` samples (2 per group) from the stage, with log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    strategy = make_strategy(stage.sde, eta)
    cond = {"c": torch.randn(n, generator=g)}
    x = torch.randn(n, stage.module.in_channels, 4, 4, generator=g)
    latents, lps = [x], []
    with torch.no_grad():
        for i in range(len(SIGMAS) - 1):
            v = stage.velocity(x, SIGMAS[i].expand(n), cond, 1.0)
            sde = i in sde_indices
            noise = torch.randn(x.shape, generator=g) if sde else None
            out = strategy.step(x, v, SIGMAS, i, sde=sde, noise=noise)
            if sde:
                lps.append(out.log_prob)
            x = out.next_sample
            latents.append(x)
    seg = LatentSegment(
        latents=torch.stack(latents, dim=1),
        positions=list(range(len(SIGMAS))),
        sigmas=SIGMAS.clone(),
        sde_indices=list(sde_indices),
        log_probs=torch.stack(lps, dim=1),
        eta=eta,
        guidance_scale=1.0,
    )
    return RolloutTrack(
        name="diffusion",
        sample_ids=[f"s{i}" for i in range(n)],
        group_ids=[f"g{i // 2}" for i in range(n)],
        prompts=["p"] * n,
        metadata=[{}] * n,
        segment=seg,
        conditions=cond,
        advantages=torch.linspace(-1.5, 2.0, n),
    )


def perturb(stage: LinearStage, scale: float = 0.1, seed: int = 3) -> None:
    """Move the weights off the sampling ones (later updates of a rollout)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stage.module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def hand_replay(stage: LinearStage, track: RolloutTrack):
    """Per SDE step of the stored trajectory: log-probs [B, k], means [B, k, ...], transition
    std [k], dt [k] and velocities [B, k, ...] under the stage's current weights."""
    seg = track.segment
    strategy = make_strategy(stage.sde, seg.eta)
    lps, means, stds, dts, vs = [], [], [], [], []
    for i in seg.sde_indices:
        x = seg.at(i)
        v = stage.module(x) * (1 + seg.sigmas[i]) + track.conditions["c"].view(-1, 1, 1, 1)
        mean, std, _ = strategy.mean_and_std(x, v, seg.sigmas, i)
        lps.append(gaussian_log_prob(seg.at(i + 1), mean, std))
        means.append(mean)
        stds.append(std)
        dts.append(seg.sigmas[i + 1] - seg.sigmas[i])
        vs.append(v)
    stack = torch.stack
    return stack(lps, 1), stack(means, 1), stack(stds), stack(dts), stack(vs, 1)


def flow_grpo_reference_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
) -> torch.Tensor:
    """Flow-GRPO's policy loss as its training loop writes it (yifan123/flow_grpo,
    scripts/train_sd3.py, `main`, the "grpo logic" block), on log-probs [B, K] and advantages [B]:
    per timestep j the advantage is clamped to [-adv_clip_max, adv_clip_max], ratio =
    exp(logp_j - logp_old_j), and the step's loss is the batch mean of max(-A ratio,
    -A clamp(ratio, 1 - clip_range, 1 + clip_range)); gradient accumulation over the K timesteps
    averages them. DanceGRPO's and MixGRPO's `train_one_step` (fastvideo/train_grpo_flux.py) write
    the same policy loss."""
    steps = []
    for j in range(new_logp.shape[1]):
        adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
        ratio = torch.exp(new_logp[:, j] - old_logp[:, j])
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
        steps.append(torch.mean(torch.maximum(unclipped, clipped)))
    return torch.stack(steps).mean()


def loss_and_grads(algo, stage: LinearStage, track: RolloutTrack, ctx: dict | None = None):
    """The algorithm's metrics and the gradient of its loss on the track under the current weights."""
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, track, {"loss_scale": 1.0, "progress": 0.0, **(ctx or {})})
    return out, [p.grad.clone() for p in stage.module.parameters()]


def grads_of(loss: torch.Tensor, stage: LinearStage) -> list[torch.Tensor]:
    stage.module.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in stage.module.parameters()]


def assert_relative(got: list[torch.Tensor], want: list[torch.Tensor], rel: float) -> None:
    """The gradients, as one vector, agree to `rel` of the reference's norm."""
    g = torch.cat([x.flatten() for x in got])
    w = torch.cat([x.flatten() for x in want])
    assert float(w.norm()) > 0, "the reference gradient is zero: the comparison would prove nothing"
    assert float((g - w).norm()) <= rel * float(w.norm()), float((g - w).norm() / w.norm())
