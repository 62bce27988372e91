"""The flow-matching families' per-step value model (Flow-PPO's critic).

A diffusion rollout is an MDP over its SDE steps: the state before SDE step k is
(x_{i_k}, sigma_{i_k}, prompt), i_k = `LatentSegment.sde_indices[k]`; the reward comes after
the last step. `FlowValueNet` maps such a state to V, a scalar:

    x      [N, C, h, w] latent (any family with image latents: `latent_shape` is (C, h, w))
    sigma  [N]          noise level in [0, 1]
    prompt [N, D]       the policy's prompt embedding (`cond_key` of the track's conditions,
                        [N, D], or [N, L, D] averaged over its L tokens)
    -> V   [N]          fp32

Latent: three 3x3 convolutions (the last two stride 2), SiLU, global average pool -> [N, width];
sigma: Fourier features (sigma, sin / cos(2^j pi sigma), j < 4) -> Linear -> [N, width]; prompt:
LayerNorm -> Linear -> [N, width]; the three concatenated -> MLP (width) -> `head`,
Linear(width, 1). It is a small network of its own (a few 10k parameters at width 32), not a
copy of the denoiser: it trains whole, beside the policy, on the GAE returns.

`FlowValueConfig.build_value_stage(policy)` reads the latent channels and the embedding width
from the policy's stage (the bundle's `latent_shape`, one empty prompt encoded), so a recipe
names no dimensions. `FlowValueStage.values(track)` is the critic's forward on a diffusion
track: [B, K] fp32, V of the state before each SDE step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from unirl.models.stage import ModuleOwner
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment

NUM_FREQS = 4


class FlowValueNet(nn.Module):
    """V(x, sigma, prompt) (see the module docstring for shapes).

    Args:
        latent_channels: C of the latents.
        cond_dim: D of the prompt embedding.
        width: hidden width of every branch and of the MLP.
    """

    def __init__(self, latent_channels: int, cond_dim: int, width: int = 32) -> None:
        super().__init__()
        self.latent = nn.Sequential(
            nn.Conv2d(latent_channels, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.sigma = nn.Linear(1 + 2 * NUM_FREQS, width)
        self.prompt = nn.Sequential(nn.LayerNorm(cond_dim), nn.Linear(cond_dim, width))
        self.mlp = nn.Sequential(nn.Linear(3 * width, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU())
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """[N] fp32 values of x [N, C, h, w], sigma [N], prompt [N, D] or [N, L, D]."""
        dtype = self.head.weight.dtype
        if prompt.dim() == 3:
            prompt = prompt.mean(dim=1)
        s = sigma.to(dtype)[:, None]
        freqs = (2.0 ** torch.arange(NUM_FREQS, device=s.device, dtype=dtype)) * math.pi
        fourier = torch.cat([s, torch.sin(s * freqs), torch.cos(s * freqs)], dim=1)
        h = torch.cat([self.latent(x.to(dtype)), self.sigma(fourier), self.prompt(prompt.to(dtype))], dim=1)
        return self.head(self.mlp(h))[:, 0].float()


@dataclass
class FlowValueConfig:
    """`critic.model` of a diffusion recipe: the per-step value network.

    Attributes:
        cond_key: which of the policy's conditions is the prompt embedding (a key of the
            family's `cond_keys`, e.g. "pooled_prompt_embeds" or "prompt_embeds").
        width: hidden width (see `FlowValueNet`).
        head_seed: seed of the network's initial weights.
    """

    cond_key: str = "pooled_prompt_embeds"
    width: int = 32
    head_seed: int = 0

    modality: ClassVar[str] = "diffusion"  # the tracks it values (checked by the validator)
    head_name: ClassVar[str] = "head"  # the head's module name (trained whole under LoRA)

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"critic.model.width must be >= 1, got {self.width}")

    def trainable_on_meta(self) -> nn.Module:
        """The network's module tree on the meta device (its names do not depend on the policy's
        dimensions; validators read only names)."""
        with torch.device("meta"):
            return FlowValueNet(1, 1, self.width)

    def build_value_stage(self, policy: Any = None) -> FlowValueStage:
        """The critic on the CPU, sized for `policy` (a `FlowMatchingStage`: its bundle's latent
        channels, and the width of `cond_key` for one encoded empty prompt)."""
        if policy is None or not hasattr(policy, "bundle"):
            raise ValueError(
                "critic.model: FlowValueConfig reads its dimensions from the policy's flow-matching stage"
            )
        bundle = policy.bundle
        shape = bundle.latent_shape(bundle.sample_size, bundle.sample_size)
        if len(shape) != 3:
            raise ValueError(
                f"critic.model: the value network takes [C, h, w] latents, the policy's are {shape}"
            )
        cond = policy.encode_prompts([""], 1.0, 8)
        if self.cond_key not in cond:
            raise ValueError(
                f"critic.model.cond_key={self.cond_key!r} is not one of the policy's conditions {sorted(cond)}"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.head_seed)
            net = FlowValueNet(shape[0], int(cond[self.cond_key].shape[-1]), self.width)
        return FlowValueStage(net, self.cond_key)


class FlowValueStage(ModuleOwner):
    """The critic's forward on diffusion tracks. `module` is what is called; the train backend
    replaces it with its wrapped module."""

    def __init__(self, model: nn.Module, cond_key: str) -> None:
        self.module: nn.Module = model
        self.cond_key = cond_key

    def values(self, track: RolloutTrack) -> torch.Tensor:
        """[B, K] fp32: V of the state before each SDE step of the track's `LatentSegment`
        (latent `segment.at(i)`, sigma `segment.sigmas[i]`, the track's `cond_key` condition),
        all B*K states in one forward. Differentiable."""
        seg = track.segment
        if not isinstance(seg, LatentSegment):
            raise ValueError(
                f"track {track.name!r} holds a {type(seg).__name__}; the flow critic needs latents"
            )
        if self.cond_key not in track.conditions:
            raise ValueError(
                f"critic.model.cond_key={self.cond_key!r} is not in track {track.name!r}'s conditions "
                f"{sorted(track.conditions)}"
            )
        device, b, steps = self.device, len(seg), seg.sde_indices
        x = torch.cat([seg.at(i) for i in steps]).to(device)
        sigma = torch.cat([seg.sigmas[i].expand(b) for i in steps]).to(device)
        prompt = track.conditions[self.cond_key].to(device)
        prompt = prompt.repeat(len(steps), *([1] * (prompt.dim() - 1)))
        return self.module(x, sigma, prompt).view(len(steps), b).T.contiguous()
