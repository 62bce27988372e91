"""Supervised flow-matching training of a text-to-image or text-to-video bundle (pretraining /
the SFT stage).

Loss (rectified flow, as SD3): for clean images (or videos) x0 in [-1, 1], noise eps and
noise level sigma, x_sigma = (1 - sigma) x0 + sigma eps and the denoiser is
regressed onto the velocity v = eps - x0:  L = mean ||v_theta(x_sigma, sigma, c) - v||^2.
sigma is drawn logit-normal (SD3's default) or uniform, then shifted like the
sampling schedule. With probability `cond_dropout` the prompt is replaced by
"" so classifier-free guidance works at sampling time. The transformer and
(optionally) the text encoders are trained; the run is resumable from its
`sft_state.pt`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Protocol

import numpy as np
import torch
from annotated_types import Interval

from unirl.models.flow.family import FlowFamily, training_guidance
from unirl.sde.schedules import check_sigma_sampling, sample_sigmas
from unirl.train.backend import LRSchedule
from unirl.train.supervised import SupervisedConfig, SupervisedRun
from unirl.types.constraints import AtLeastOne, NonNegativeInt, Positive


@dataclass
class FlowObjectiveConfig(SupervisedConfig):
    """`SupervisedConfig` plus what every flow-matching objective's noising reads (supervised
    flow matching, offline Diffusion-DPO).

    Attributes:
        sigma_sampling: "logit_normal" (sigmoid of N(0, 1)) or "uniform".
        shift: sigma = shift*t / (1 + (shift-1)*t), matching the sampling schedule.
        max_sequence_length: T5 token budget.
        guidance_scale: the guidance scale an "embedded" family (FLUX.1-dev) is trained at,
            a network input (`training_guidance`); 1.0 for a family that trains unguided.
    """

    sigma_sampling: str = "logit_normal"
    shift: Positive = 1.0
    max_sequence_length: AtLeastOne = 16
    guidance_scale: Positive = 1.0

    def __post_init__(self) -> None:
        check_sigma_sampling(self.sigma_sampling)
        super().__post_init__()


@dataclass
class FlowMatchingSFTConfig(FlowObjectiveConfig):
    """Settings of a supervised flow-matching run: `FlowObjectiveConfig` (batch_size: images per
    step) plus

    Attributes:
        cond_dropout: probability of training on the empty prompt.
        train_text_encoders: also train the text encoders (a tiny model's are random).
    """

    num_steps: AtLeastOne = 10000
    warmup_steps: NonNegativeInt = 200
    lr_schedule: LRSchedule = "cosine"
    eval_every: NonNegativeInt = 1000
    cond_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.1
    train_text_encoders: bool = True


class ImageTextSource(Protocol):
    """Supervised data: `sample_batch(n, rng) -> (uint8 images [n, H, W, 3], prompts)`, or uint8
    videos [n, F, H, W, 3] for a video family (F = the model's `num_frames`)."""

    def sample_batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]: ...


def flow_matching_loss(pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the predicted velocity against eps - x0 (fp32 scalar)."""
    return ((pred.float() - (eps - x0).float()) ** 2).mean()


def images_to_model(images: np.ndarray) -> torch.Tensor:
    """uint8 images [n, H, W, 3] -> fp32 [n, 3, H, W], or videos [n, F, H, W, 3] -> [n, 3, F, H, W]
    (a video family's latent layout), in [-1, 1] (the pixel-space model's range)."""
    return torch.from_numpy(images).float().movedim(-1, 1) / 127.5 - 1.0


def check_data_geometry(x0: torch.Tensor, info: dict, size: int | None) -> None:
    """Raise naming the model key unless `x0` ([n, 3, H, W] or [n, 3, F, H, W]) has sides the
    model takes: multiples of its VAE scale x patch, and at most `size` (a tiny model's
    resolution, the extent of its position embedding; None: a model that takes any such side,
    such as a Wan directory), and, for a video family (`info["num_frames"]`), its frame count.
    A tiny model of resolution 64 trains on 32x64 images, as it samples them."""
    cell = int(info.get("vae_scale_factor", 1)) * int(info.get("patch_size", 1))
    if any(side % cell for side in x0.shape[-2:]):
        raise ValueError(
            f"the data gives {tuple(x0.shape[-2:])} frames but the model takes sides that are "
            f"multiples of {cell} (its VAE's scale x its patch); resize the data"
        )
    if size is not None and max(x0.shape[-2:]) > size:
        raise ValueError(
            f"the data gives {tuple(x0.shape[-2:])} frames but the model is built for sides of at "
            f"most {size} (raise model.tiny.resolution to the data's longer side)"
        )
    frames = info.get("num_frames")
    if frames is None and x0.dim() != 4:
        raise ValueError(
            f"the data gives videos {tuple(x0.shape)} but the model is an image model "
            "(pair a video family's model with video data, or give images [n, H, W, 3])"
        )
    if frames is not None and (x0.dim() != 5 or x0.shape[2] != frames):
        got = f"{x0.shape[2]}-frame videos" if x0.dim() == 5 else "images"
        raise ValueError(f"the data gives {got} but model.num_frames={frames}; match them")


class FlowMatchingSFT(SupervisedRun):
    """Trains `bundle` on `data` with the flow-matching loss, through the shared resumable
    loop (`unirl.train.supervised.SupervisedRun`).

    Args:
        bundle: a pixel-space flow-matching bundle (a `FlowFamily`; a VAE is not supported here),
            on the device to train on. Noise and timesteps are drawn on the CPU from
            the seeded generator (the same run on every device) and moved there.
        data: the supervised source.
        config: run settings.
        out_dir: where `sft_state.pt` (resumable) and `sft_log.jsonl` go.
        evaluate: optional `evaluate(bundle) -> dict[str, float]` run every
            `eval_every` steps and at the end; its numbers go into the log.
    """

    log_name = "sft_log.jsonl"

    def __init__(
        self,
        bundle: FlowFamily,
        data: ImageTextSource,
        config: FlowMatchingSFTConfig,
        out_dir: str,
        evaluate: Callable[[FlowFamily], dict[str, float]] | None = None,
    ) -> None:
        if not bundle.model_info()["pixel_space"]:
            raise ValueError("FlowMatchingSFT trains pixel-space bundles (model.tiny.pixel_space: true)")
        self.bundle, self.data = bundle, data
        modules = [bundle.denoiser]
        if config.train_text_encoders:
            modules += bundle.text_encoders()
        training_guidance(bundle, torch.ones(1), config.guidance_scale)  # refused before any step
        super().__init__(modules, config, out_dir, evaluate, bundle)

    def batch_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """The flow-matching loss of a fresh batch (prompts dropped to "" with `cond_dropout`)."""
        cfg = self.cfg
        images, prompts = self.data.sample_batch(cfg.batch_size, self.rng)
        drop = torch.rand(len(prompts), generator=self.gen) < cfg.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        device = self.bundle.device
        x0 = images_to_model(images).to(device)
        size = None if getattr(self.bundle, "any_size", False) else self.bundle.sample_size
        check_data_geometry(x0, self.bundle.model_info(), size)
        eps = torch.randn(x0.shape, generator=self.gen).to(device)
        sigma = sample_sigmas(len(prompts), cfg, self.gen).to(device)
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        x_t = (1 - s) * x0 + s * eps
        cond = self.bundle.encode_text(prompts, False, cfg.max_sequence_length)
        guidance = training_guidance(self.bundle, sigma, cfg.guidance_scale)
        pred = self.bundle.predict(self.bundle.denoiser, x_t, sigma, cond, **guidance)
        return flow_matching_loss(pred, x0, eps), {}

    def export(self, path: str, dtype: torch.dtype = torch.float16) -> None:
        """`export_bundle` of the trained bundle."""
        export_bundle(self.bundle, path, dtype)


def export_bundle(bundle: FlowFamily, path: str, dtype: torch.dtype = torch.float16) -> None:
    """Save the whole bundle (`save_pretrained`, the family's library layout) with weights in
    `dtype`; the in-memory model goes back to fp32 weights."""
    bundle.to(dtype)
    try:
        bundle.save_pretrained(path)
    finally:
        bundle.to(torch.float32)
