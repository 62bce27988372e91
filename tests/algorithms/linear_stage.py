"""A stand-in diffusion stage for loss tests that need no real denoiser: a 1x1 convolution
whose velocity depends on x, sigma and a per-sample condition, sampled and replayed with the
shared SDE strategies exactly as the flow stage does (`unirl/models/flow/stage.py`). A loss
computed through it can be checked against the same formula written out in a test in
milliseconds instead of a tiny SD3's seconds."""

from __future__ import annotations

import contextlib

import torch

from unirl.sde.strategies import make_strategy
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

    def replay_chunks(self, steps: list[int]):
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
