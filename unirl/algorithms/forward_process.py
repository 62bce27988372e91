"""Forward-process losses: training times drawn apart from the sampling schedule.

A forward-process loss reads only a rollout's final latents x0 (and, for the discrete
distributions, its pinned sigma schedule). Per sample and draw it takes a noise level s
from `timestep_distribution` within `timestep_range`, a noise eps ~ N(0, I), and trains
at
    x_s = (1 - s) x0 + s eps,        velocity target  eps - x0,
so the sampler that produced x0 (ODE, SDE, CPS, DPM-Solver++) never enters the loss.

Distributions of s (`timestep_range` = [lo, hi] bounds s itself, 0 <= lo < hi <= 1):
    discrete            uniform over the schedule's sigmas sigma_1..sigma_{T-1} in [lo, hi]
    discrete_with_init  the same including sigma_0 (= 1, the initial noise)
    uniform             u ~ U(0, 1)
    logit_normal        u = sigmoid(z), z ~ N(0, 1)
and for the continuous ones s = lo + (hi - lo) * k u / (1 + (k - 1) u), k = `timestep_shift`
(k = 1: no shift; k > 1 moves mass toward noise, as SD3's schedule shift does).

Randomness: one CPU generator per sample seeded by (`seed`, sample id), or per prompt group
(`shared_noise: true`: the siblings of a prompt share s and eps, DGPO-style), so batching,
rank and resume do not change the draws. They are drawn once per rollout in
`prepare_segment` and reused by every update of that rollout (a ratio against the sampling
weights needs the same (s, eps) on both sides); each rollout's samples draw afresh.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.types.constraints import AtLeastOne, Positive, check_fields
from unirl.types.rollout_resp import RolloutTrack

TimestepDistribution = Literal["discrete", "discrete_with_init", "uniform", "logit_normal"]
DISCRETE = ("discrete", "discrete_with_init")
RANGE_TOL = 1e-6  # a schedule's fp32 sigma counts as inside [lo, hi] within this


@dataclass
class ForwardProcessConfig:
    """How a forward-process loss draws its training times and noise.

    Attributes:
        timestep_distribution: "discrete", "discrete_with_init", "uniform" or "logit_normal"
            (module docstring).
        timestep_range: [lo, hi], the noise levels s may take, 0 <= lo < hi <= 1. A reference
            that states a "timestep range" r as a fraction of the denoising axis from the
            noisy end (Flow-Factory, DGPO's 0.6) means [1 - r, 1].
        timestep_shift: k > 0, the shift of the continuous distributions (1: none). Must be 1
            for the discrete ones, whose schedule is already shifted.
        draws_per_sample: (s, eps) draws per sample and update; each costs one forward.
        shared_noise: the samples of a prompt group share their draws (seeded by the group
            id) instead of drawing their own (seeded by the sample id).
        seed: with the sample (or group) id, seeds every draw.
    """

    timestep_distribution: TimestepDistribution = "discrete_with_init"
    timestep_range: tuple[float, float] = (0.0, 1.0)
    timestep_shift: Positive = 1.0
    draws_per_sample: AtLeastOne = 1
    shared_noise: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")
        rng = tuple(self.timestep_range)
        if len(rng) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in rng):
            raise ValueError(f"algorithm.config.timestep_range must be [lo, hi], got {list(rng)}")
        lo, hi = float(rng[0]), float(rng[1])
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"algorithm.config.timestep_range must be [lo, hi] with 0 <= lo < hi <= 1 (bounds on the "
                f"noise level s), got {list(rng)}"
            )
        self.timestep_range = (lo, hi)
        if self.timestep_distribution in DISCRETE and self.timestep_shift != 1.0:
            raise ValueError(
                f"algorithm.config.timestep_shift={self.timestep_shift} applies to the uniform and logit_normal "
                f"distributions; {self.timestep_distribution} draws the schedule's own (already shifted) sigmas, "
                "so set timestep_shift: 1.0"
            )


def shift(u: torch.Tensor, k: float) -> torch.Tensor:
    """k u / (1 + (k - 1) u), the schedule shift (identity at k = 1)."""
    return u if k == 1.0 else k * u / (1 + (k - 1) * u)


def discrete_candidates(sigmas: torch.Tensor, num_steps: int, cfg: ForwardProcessConfig) -> torch.Tensor:
    """Indices i into `sigmas` (< num_steps) a discrete distribution draws from; raises naming
    the keys when `timestep_range` holds none of the schedule's sigmas."""
    lo, hi = cfg.timestep_range
    first = 0 if cfg.timestep_distribution == "discrete_with_init" else 1
    idx = torch.arange(first, num_steps)
    sig = sigmas[idx].double()
    keep = idx[(sig >= lo - RANGE_TOL) & (sig <= hi + RANGE_TOL)]
    if len(keep) == 0:
        raise ValueError(
            f"algorithm.config.timestep_range={list(cfg.timestep_range)} holds none of the schedule's sigmas "
            f"{[round(float(s), 4) for s in sigmas[first:num_steps]]} that {cfg.timestep_distribution} draws from; "
            "widen the range or use a continuous timestep_distribution (uniform, logit_normal)"
        )
    return keep


def draw_sigmas(
    gen: torch.Generator, k: int, cfg: ForwardProcessConfig, sigmas: torch.Tensor, num_steps: int
) -> torch.Tensor:
    """[k] noise levels from `gen` (dtype of `sigmas`); the discrete ones index `sigmas`."""
    if cfg.timestep_distribution in DISCRETE:
        cand = discrete_candidates(sigmas, num_steps, cfg)
        return sigmas[cand[torch.randint(0, len(cand), (k,), generator=gen)]]
    if cfg.timestep_distribution == "uniform":
        u = torch.rand((k,), generator=gen, dtype=torch.float64)
    else:
        u = torch.sigmoid(torch.randn((k,), generator=gen, dtype=torch.float64))
    lo, hi = cfg.timestep_range
    return (lo + (hi - lo) * shift(u, cfg.timestep_shift)).to(sigmas.dtype)


def per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[N] values shaped to broadcast over the non-batch dims of `like` [N, ...]."""
    return values.view(-1, *([1] * (like.dim() - 1)))


class ForwardProcessAlgorithm(StageAlgorithm):
    """Base of the forward-process losses on a diffusion track.

    `with_draws(track)` adds the per-sample draws to `track.conditions` under `prefix`
    (`{prefix}sigma` [B, k], `{prefix}noise` [B, k, C, h, w]; they travel with `select`);
    `inputs(track)` flattens them to B * k rows (draw-major within a sample) with x_s, x0,
    s and the stage's conditions repeated. A subclass sets `prefix`, freezes what it needs
    under the sampling weights in `prepare_segment` and computes its loss.
    """

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    prefix: ClassVar[str] = "fp/"
    config: ForwardProcessConfig

    @property
    def sigma_key(self) -> str:
        return self.prefix + "sigma"

    @property
    def noise_key(self) -> str:
        return self.prefix + "noise"

    def check_sampling(self, sampling) -> None:
        """Before Ray: a discrete distribution's range holds some sigma of the recipe's schedule
        (computed at the schedule's base token count, as `check_sde` does); then the config's
        loss-side guidance scales, its `*_guidance_scale` fields (`check_guidance`)."""
        if self.config.timestep_distribution in DISCRETE:
            from unirl.sde.schedules import sigmas_for

            discrete_candidates(sigmas_for(sampling, sampling.base_seq_len), sampling.num_steps, self.config)
        scales = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
        check_guidance(sampling, **{k: v for k, v in scales.items() if k.endswith("_guidance_scale")})

    @staticmethod
    def check_prepared(track: RolloutTrack, key: str) -> None:
        """Before a loss: `track` has advantages and `prepare_segment` has put `key` in its
        conditions; a ValueError naming the track otherwise."""
        if track.advantages is None:
            raise ValueError(f"track {track.name!r} has no advantages: compute them before training")
        if key not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")

    def draws(self, track: RolloutTrack) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample (sigma [B, k], noise [B, k, C, h, w]) from the sample (or group) ids."""
        seg, cfg = track.segment, self.config
        shape = seg.final.shape[1:]
        keys = track.group_ids if cfg.shared_noise else track.sample_ids
        sigmas, noises = [], []
        for key in keys:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}:{key}".encode()))
            sigmas.append(draw_sigmas(gen, cfg.draws_per_sample, cfg, seg.sigmas, seg.num_steps))
            noises.append(torch.randn((cfg.draws_per_sample, *shape), generator=gen))
        return torch.stack(sigmas), torch.stack(noises)

    def with_draws(self, track: RolloutTrack) -> RolloutTrack:
        """`track` with its draws in `conditions` (the input track is left as it was)."""
        sigma, noise = self.draws(track)
        conditions = {**track.conditions, self.sigma_key: sigma, self.noise_key: noise}
        return dataclasses.replace(track, conditions=conditions)

    def inputs(self, track: RolloutTrack) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Flattened (x_s, x0, s, cond) over B * k rows, draw-major within a sample."""
        k = self.config.draws_per_sample
        x0 = track.segment.final.float()
        sigma = track.conditions[self.sigma_key].reshape(-1)
        noise = track.conditions[self.noise_key].flatten(0, 1)
        x0_rep = x0.repeat_interleave(k, dim=0)
        s = per_row(sigma, x0_rep)
        x_t = (1 - s) * x0_rep + s * noise
        cond = {
            key: v.repeat_interleave(k, dim=0)
            for key, v in track.conditions.items()
            if not key.startswith(self.prefix)
        }
        return x_t, x0_rep, sigma, cond

    def target(self, track: RolloutTrack) -> torch.Tensor:
        """[B * k, C, h, w] the velocity target eps - x0 of each row."""
        x0 = track.segment.final.float().repeat_interleave(self.config.draws_per_sample, dim=0)
        return track.conditions[self.noise_key].flatten(0, 1) - x0


def draw_errors(v: torch.Tensor, target: torch.Tensor, draws: int) -> torch.Tensor:
    """[B, draws] flow-matching error of each sample and draw: mean (v - target)^2 over the
    non-batch dims (v and target [B * draws, ...], draw-major within a sample)."""
    err = ((v.float() - target) ** 2).mean(dim=tuple(range(1, v.dim())))
    return err.view(-1, draws)


def group_index(group_ids: list[str]) -> tuple[torch.Tensor, int]:
    """(index [B] of each sample's group in order of first appearance, number of groups)."""
    order = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    return torch.tensor([order[g] for g in group_ids], dtype=torch.long), len(order)


def decay_schedule(value, key: str, update_on: str) -> dict:
    """`unirl.train.ema.EMAConfig` keywords of a snapshot whose decay follows
    [start, d0, slope, d_max]: 0 (the snapshot copies the weights) for its first `start`
    updates, then min(d_max, d0 + slope (t - start)). Raises naming `key`."""
    vals = list(value) if isinstance(value, (list, tuple)) else None
    ok = (
        vals is not None
        and len(vals) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals)
    )
    if not ok or not (
        float(vals[0]).is_integer() and vals[0] >= 0 and 0 <= vals[1] < 1 and vals[2] >= 0 and 0 < vals[3] < 1
    ):
        raise ValueError(
            f"{key} must be [start_step (int >= 0), initial decay in [0, 1), slope >= 0, max decay in (0, 1)], "
            f"got {value!r}"
        )
    return {
        "decay": float(vals[3]),
        "schedule": "linear",
        "warmup_steps": int(vals[0]),
        "decay_start": float(vals[1]),
        "decay_slope": float(vals[2]),
        "update_on": update_on,
    }


def check_guidance(sampling, **scales: float | None) -> None:
    """Before Ray: a loss-side guidance scale > 1 needs the rollout's negative conditions, which
    a rollout encodes only when it samples with CFG (sampling.guidance_scale > 1)."""
    for key, scale in scales.items():
        if scale is not None and scale > 1.0 and sampling.guidance_scale <= 1.0:
            raise ValueError(
                f"algorithm.config.{key}={scale} runs classifier-free guidance, which needs the negative "
                f"prompt conditions of a guided rollout, but sampling.guidance_scale={sampling.guidance_scale}; "
                f"set {key} <= 1 or sampling.guidance_scale > 1"
            )
