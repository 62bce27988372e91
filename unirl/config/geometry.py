"""Rules of batch geometry: how the samples of a step split over devices and micro-batches, and
how an image's size fits the model's latent patch grid."""

from __future__ import annotations

import json
import os
from typing import Any

from unirl.types.sampling import DiffusionSamplingParams


def model_geometry(model: Any) -> tuple[int, int | None] | None:
    """(pixels per latent patch, largest height/width or None) of an SD3 model config, when knowable."""
    if model is None or getattr(model, "modality", None) != "diffusion":
        return None
    if not model.pretrained_path:
        tiny = model.tiny
        return (1 if tiny.pixel_space else 2) * tiny.patch_size, tiny.resolution
    try:
        with open(os.path.join(model.pretrained_path, "transformer", "config.json")) as f:
            patch = json.load(f)["patch_size"]
        vae_config = os.path.join(model.pretrained_path, "vae", "config.json")
        scale = 1
        if os.path.exists(vae_config):
            with open(vae_config) as f:
                scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    except (OSError, KeyError, ValueError):
        return None  # an unreadable model directory is reported by the model checks
    return scale * patch, None


def check_geometry(run: Any, sampling: Any, stack: Any, model: Any, problems: list[str]) -> None:
    """Batch geometry vs devices and micro-batches; image size vs the model's patch grid."""
    if run is not None and sampling is not None:
        world = run.num_devices
        total = run.prompts_per_rollout * sampling.samples_per_prompt
        if total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x sampling.samples_per_prompt "
                f"({sampling.samples_per_prompt}) = {total} samples do not split evenly over num_devices={world}"
            )
        elif stack is not None and (total // world) % stack.micro_batch_size:
            problems.append(
                f"batch geometry: train.stack.micro_batch_size={stack.micro_batch_size} does not divide the "
                f"per-rank batch of {total // world} samples (prompts_per_rollout x samples_per_prompt / num_devices)"
            )
    geometry = model_geometry(model) if isinstance(sampling, DiffusionSamplingParams) else None
    if geometry is not None:
        cell, largest = geometry
        for key in ("height", "width"):
            value = getattr(sampling, key)
            if value % cell:
                problems.append(
                    f"sampling.{key}={value} must be a multiple of {cell}, the pixels per latent patch of the model"
                )
            if largest is not None and value > largest:
                problems.append(
                    f"sampling.{key}={value} exceeds model.tiny.resolution={largest}, the largest size "
                    "the tiny model's position embedding covers"
                )
