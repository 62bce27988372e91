"""FLUX.1-Kontext: FLUX.1 that edits a condition image (`FluxKontextPipeline`).

The same transformer, text encoders, VAE, packing and embedded guidance as FLUX.1 (`bundle.py`);
what differs is the condition: each sample's prompt row names one reference image
(`metadata["images"]`, resolved against the prompt file like a vision-language row's), which the
stage encodes once per request (`FlowMatchingStage.encode_conditions`) into `image_latents`
[B, C, h', w'] (the VAE's mode, `(latents - shift) * scaling`, as the pipeline's
`_encode_vae_image`; the pixels themselves in pixel space). Every network call appends the
reference's packed tokens after the sample's, with position ids whose first coordinate is 1, and
reads the velocity from the sample's tokens only (`FluxKontextPipeline.__call__`'s arithmetic).
The reference travels with the track as a condition (`track.conditions["image_latents"]`), so
replay, kept graphs, every transport and resume see it; the reward sees its path in the
metadata.

The reference keeps its own size (a multiple of the VAE's downsample x 2; the pipeline's
`_auto_resize` to its preferred resolutions is not applied: a recipe's images are the size it
gives them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from diffusers import FluxKontextPipeline

from unirl.models.flow.config import ConditionedFamilyConfig, FamilySpec
from unirl.models.flux import bundle as flux
from unirl.models.flux.bundle import FluxBundle, image_ids, pack, tiny_transformer  # noqa: F401 (the tiny denoiser: FLUX.1's)
from unirl.models.flux.config import FluxModelConfig
from unirl.models.images import one_metadata_image, row_images
from unirl.types import RolloutReq

CONDITION_KEY = "images"
"""The default prompt-row metadata key naming a sample's condition image (one path, array or PIL
image); `FluxKontextModelConfig.condition_key` names another (a composed run's rows whose `images`
the text track would read as its own)."""


class FluxKontextBundle(FluxBundle):
    """A FLUX.1-Kontext model: `FluxBundle` over a `FluxKontextPipeline`, conditioned on one
    reference image per sample (`cond_keys` adds `image_latents`)."""

    cond_keys = ("prompt_embeds", "pooled_prompt_embeds", "image_latents")
    PIPELINE: ClassVar[type] = FluxKontextPipeline
    condition_key: str = CONDITION_KEY  # the metadata key of a sample's source (set by the config)

    @property
    def cell(self) -> int:
        """Pixels per packed token along a side: a reference's sides are multiples of it."""
        return 2 * self.vae_scale_factor

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq, guided: bool = False) -> dict[str, torch.Tensor]:
        """{"image_latents": [B, C, h', w'] fp32} from each sample's `metadata[condition_key]` (the
        request's rows; `guided` changes nothing: the guidance is embedded): exactly one image, sides multiples of `cell`, every reference of
        a request one size. Encoded as `FluxKontextPipeline` encodes its `image` list: resized to
        its own size, `preprocess`ed to [-1, 1] as one batch, the VAE's mode of that batch in one
        call, shifted and scaled (the pixels themselves in pixel space). Errors name the sample."""
        images, sample_ids = [], req.sample_ids
        for sid, meta in zip(sample_ids, req.metadata, strict=True):
            image = one_metadata_image(
                meta, self.condition_key, sid, "FLUX.1-Kontext edits one condition image"
            )
            if image.width % self.cell or image.height % self.cell:
                raise ValueError(
                    f"sample {sid!r}: condition image of {image.width}x{image.height} px; FLUX.1-Kontext takes "
                    f"sides that are multiples of {self.cell} px (the VAE's downsample x the 2x2 packing)"
                )
            if images and image.size != images[0].size:
                raise ValueError(
                    f"sample {sid!r}: condition image of {image.width}x{image.height} px beside "
                    f"{images[0].width}x{images[0].height} px in the same request (sample {sample_ids[0]!r}); "
                    "give every row of a prompt file images of one size"
                )
            images.append(image)
        width, height = images[0].size
        processor = self.pipeline.image_processor
        pixels = processor.preprocess(processor.resize(images, height, width), height, width)
        pixels = pixels.to(self.device, torch.float32)
        if self.vae is None:
            return {"image_latents": pixels}
        vae = self.vae
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        return {"image_latents": ((latents - vae.config.shift_factor) * vae.config.scaling_factor).float()}

    def image_tokens(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample's packed latents, then the reference's, with the reference's position ids
        (1, row, col) after the sample's (0, row, col)."""
        tokens, ids = super().image_tokens(x, cond)
        reference = cond["image_latents"].to(x.dtype)
        _, _, h, w = reference.shape
        ref_ids = image_ids(h // 2, w // 2)
        ref_ids[:, 0] = 1
        return torch.cat([tokens, pack(reference)], dim=1), torch.cat([ids, ref_ids])


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> FluxKontextBundle:
    """The bundle of a UniRL checkpoint of a Kontext run (FLUX.1's `load_checkpoint` into this
    bundle)."""
    return flux.load_checkpoint(path, dtype, bundle_class=FluxKontextBundle)


@dataclass
class FluxKontextModelConfig(ConditionedFamilyConfig, FluxModelConfig):
    """Which FLUX.1-Kontext model to build: a local `FluxKontextPipeline` directory, or the tiny
    FLUX.1 of `tiny` (the same architecture; Kontext differs in its inputs, not its modules).
    Its prompt rows each carry one condition image under `condition_key` (`condition_problems`;
    a data source resolves that key's relative paths when it is in its `path_keys`)."""

    SPEC: ClassVar[FamilySpec] = replace(
        FluxModelConfig.SPEC, name="FLUX.1-Kontext", bundle="unirl.models.flux.kontext.FluxKontextBundle",
        pipeline="FluxKontextPipeline",
    )  # fmt: skip
    condition_key: str = CONDITION_KEY

    def condition_problems(self, examples: list, where: str, sampling: Any = None) -> list[str]:
        """Every prompt row of `where` (its examples) names exactly one condition image that reads
        and whose sides are multiples of the packed cell, all of one size; problems name the row.
        (`sampling` is not read: Kontext's references do not enter its prompt.)"""
        cell, key = self._read("cell"), self.condition_key
        problems, sizes = [], {}
        need = "FLUX.1-Kontext edits exactly one"
        for ex, (image,) in row_images(examples, key, where, problems, "condition image(s)", need, True):
            if cell and (image.width % cell or image.height % cell):
                problems.append(
                    f"{where}: prompt {ex.prompt_id!r}: condition image {ex.metadata[key][0]!r} is "
                    f"{image.width}x{image.height} px; its sides must be multiples of {cell} px"
                )
            sizes.setdefault(image.size, ex.prompt_id)
        if len(sizes) > 1:
            problems.append(
                f"{where}: condition images of several sizes {sorted(sizes)} (e.g. prompts "
                f"{list(sizes.values())[:2]}); a request batches them: give them one size"
            )
        return problems
