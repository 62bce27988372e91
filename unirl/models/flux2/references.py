"""FLUX.2's reference images: multi-reference editing and generation (the pipelines' `image`).

The same transformer, prompt encoders, VAE, packing and guidance as FLUX.2-dev and FLUX.2-Klein
(`bundle.py`); what differs is the condition: each sample's prompt row names one or more
reference images (`metadata[condition_key]`, resolved against the prompt file like a
vision-language row's), which the stage encodes once per request
(`FlowMatchingStage.encode_conditions`) as `Flux2Pipeline.prepare_image_latents` does: each
reference floored to a multiple of the VAE's downsample x 2 (and first shrunk to 1024 x 1024 px
of area when larger), preprocessed with `resize_mode="crop"`, the VAE's mode patchified and
normalised by its batch-norm statistics, flattened to tokens, the references' tokens joined in
order, with 4-axis position ids (10 (i + 1), row, col, 0) for reference i. Every network call
appends them after the sample's tokens and reads the velocity from the sample's tokens only
(`Flux2BundleBase.predict`). Both guidance branches read the same references (`shared_keys`).

The references travel with the track as conditions (`reference_tokens` [B, R, 4C] and
`reference_ids` [B, R, 4], fp32 like every condition), so replay, kept graphs, every transport
and resume see them; the reward sees their paths in the metadata. A request batches its rows:
every row must give the same number of references with the same sizes after flooring.
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.models.flux2.bundle import Flux2Bundle, Flux2KleinBundle, tiny_transformer  # noqa: F401 (the tiny denoiser: FLUX.2's)
from unirl.models.flux2.bundle import load_checkpoint as load_base_checkpoint
from unirl.models.images import metadata_images
from unirl.types import RolloutReq

MAX_AREA = 1024 * 1024  # the pipelines shrink a larger reference to this many pixels first


def reference_size(processor: Any, image: Any, multiple: int) -> tuple[Any, int, int]:
    """(image, height, width) as `Flux2Pipeline.__call__` prepares a reference: shrunk to
    `MAX_AREA` pixels when larger, then its sides floored to multiples of `multiple`."""
    width, height = image.size
    if width * height > MAX_AREA:
        image = processor._resize_to_target_area(image, MAX_AREA)
        width, height = image.size
    return image, (height // multiple) * multiple, (width // multiple) * multiple


class ReferenceImages:
    """What a FLUX.2 bundle adds to read reference images (a mixin before the bundle class)."""

    shared_keys = ("reference_tokens", "reference_ids")
    condition_key: str = "images"  # the metadata key of a row's references (set by the config)

    def references(self, metadata: dict[str, Any], sample_id: str) -> list:
        """The PIL images of a row's `condition_key` (one or more); errors name the sample."""
        need = "FLUX.2 with references reads one or more reference images"
        return metadata_images(metadata, self.condition_key, sample_id, need)

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq, guided: bool = False) -> dict[str, torch.Tensor]:
        """{"reference_tokens": [B, R, 4C], "reference_ids": [B, R, 4]} fp32 (`guided` changes
        nothing: both branches read the same references). Each row (a group's samples share it) is
        encoded once, as the pipeline encodes its `image` list. Errors name the sample."""
        first = req.group_firsts()
        rows = {group: self._encode_row(req.metadata[i], req.sample_ids[i]) for group, i in first.items()}
        ids = {group: row["reference_ids"] for group, row in rows.items()}
        base = req.group_ids[0]
        for group, row_ids in ids.items():
            if row_ids.shape != ids[base].shape or not torch.equal(row_ids, ids[base]):
                raise ValueError(
                    f"sample {req.sample_ids[first[group]]!r}: its references pack into another token layout "
                    f"than those of sample {req.sample_ids[first[base]]!r} in the same request; give every row "
                    "of a prompt file the same number of references with the same sizes"
                )
        return {k: torch.cat([rows[g][k] for g in req.group_ids]) for k in rows[base]}

    def _encode_row(self, metadata: dict[str, Any], sample_id: str) -> dict[str, torch.Tensor]:
        pipe, processor = self.pipeline, self.pipeline.image_processor
        latents = []
        for image in self.references(metadata, sample_id):
            image, height, width = reference_size(processor, image, 2 * self.vae_scale_factor)
            if not height or not width:
                raise ValueError(
                    f"sample {sample_id!r}: a reference of {image.width}x{image.height} px is smaller than "
                    f"{2 * self.vae_scale_factor} px on a side, FLUX.2's packed cell"
                )
            pixels = processor.preprocess(image, height=height, width=width, resize_mode="crop")
            latents.append(pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None))
        ids = self.PIPELINE._prepare_image_ids(latents)
        tokens = torch.cat([self.PIPELINE._pack_latents(x) for x in latents], dim=1)
        return {"reference_tokens": tokens.float(), "reference_ids": ids.float().to(tokens.device)}


class Flux2EditBundle(ReferenceImages, Flux2Bundle):
    """FLUX.2-dev with reference images (`Flux2Pipeline`'s `image`)."""

    cond_keys = ("prompt_embeds", "reference_tokens", "reference_ids")


class Flux2KleinEditBundle(ReferenceImages, Flux2KleinBundle):
    """FLUX.2-Klein with reference images (`Flux2KleinPipeline`'s `image`)."""

    cond_keys = ("prompt_embeds", "reference_tokens", "reference_ids")


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, bundle_class: type = Flux2EditBundle):
    """A reference-reading bundle with the trained weights of a UniRL checkpoint directory
    (`unirl.models.flux2.bundle.load_checkpoint` with this file's bundle class)."""
    return load_base_checkpoint(path, dtype, bundle_class=bundle_class)
