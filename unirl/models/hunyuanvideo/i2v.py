"""HunyuanVideo 1.5 image-to-video: the text-to-video family (`bundle.py`) conditioned on each
prompt row's first frame (`HunyuanVideo15ImageToVideoPipeline`).

The same transformer, prompt encoders, VAE and guidance; what differs is the condition. Each row
names one first frame (`metadata[condition_key]`, resolved against the prompt file like a
vision-language row's), which the stage encodes once per request (`encode_conditions`) as the
pipeline does: the frame resized (`resize_mode="crop"`) to the sampled size, its VAE mode scaled
into the condition latents of the clip's first latent frame (zeros after it) beside a mask that is
1 on that frame (`prepare_cond_latents_and_mask`), and the frame's SigLIP last hidden states as the
image stream (`encode_image`). Every network call concatenates the condition after the noisy
latents along the channels and gives the image stream to the transformer; both guidance branches
read them (`shared_keys`), as the pipeline's guider passes them to both. They travel with the track
as conditions (`condition` [B, C + 1, f, h, w], `image_embeds` [B, N, D]), so replay, kept graphs,
every transport and resume see them.

The sampled size is the recipe's (`sampling.height` / `width`); the pipeline picks its own from the
frame's aspect ratio among its buckets (`calculate_default_height_width`), which a recipe matches by
giving that size.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline

from unirl.models.hunyuanvideo.bundle import HunyuanVideo15Bundle, tiny_transformer  # noqa: F401 (the tiny denoiser: T2V's)
from unirl.models.hunyuanvideo.config import TinyHunyuanVideo15Config
from unirl.models.images import one_metadata_image
from unirl.types import RolloutReq


class HunyuanVideo15I2VBundle(HunyuanVideo15Bundle):
    """A HunyuanVideo 1.5 I2V model: `HunyuanVideo15Bundle` over a
    `HunyuanVideo15ImageToVideoPipeline` (its SigLIP `image_encoder` and `feature_extractor`),
    conditioned on one first frame per sample (module doc)."""

    cond_keys = (*HunyuanVideo15Bundle.cond_keys, "condition", "image_embeds")
    shared_keys = ("condition", "image_embeds")
    PIPELINE: ClassVar[type] = HunyuanVideo15ImageToVideoPipeline
    condition_key: str = "images"  # the metadata key of a row's first frame (set by the config)

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The text encoders, the VAE and the SigLIP image encoder."""
        return [*super().frozen_modules(), self.pipeline.image_encoder]

    def first_frame(self, metadata: dict[str, Any], sample_id: str):
        """The PIL first frame of a row (exactly one image under `condition_key`); errors name
        the sample."""
        need = "HunyuanVideo 1.5 image-to-video starts from one first frame"
        return one_metadata_image(metadata, self.condition_key, sample_id, need)

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq, guided: bool = False) -> dict[str, torch.Tensor]:
        """{"condition": [B, C + 1, f, h, w], "image_embeds": [B, N, D]} fp32, each row's first
        frame encoded once as the pipeline encodes its `image` (`guided` changes nothing: both
        branches read them)."""
        sp = req.sampling
        _, frames, _, _ = self.latent_shape(sp.height, sp.width)
        pipe, dtype = self.pipeline, torch.float32
        rows = {}
        for group, i in req.group_firsts().items():
            image = self.first_frame(req.metadata[i], req.sample_ids[i])
            image = pipe.video_processor.resize(image, height=sp.height, width=sp.width, resize_mode="crop")
            latents = pipe._get_image_latents(
                pipe.vae, pipe.video_processor, image, sp.height, sp.width, self.device
            )
            condition = latents.repeat(1, 1, frames, 1, 1)
            condition[:, :, 1:] = 0
            mask = torch.zeros_like(condition[:, :1])
            mask[:, :, 0] = 1.0
            rows[group] = {
                "condition": torch.cat([condition, mask], dim=1).to(dtype),
                "image_embeds": pipe.encode_image(image, 1, self.device, dtype),
            }
        return {k: torch.cat([rows[g][k] for g in req.group_ids]) for k in ("condition", "image_embeds")}

    def image_inputs(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's first-frame condition and mask, and its SigLIP image stream."""
        return cond["condition"], cond["image_embeds"]

    @classmethod
    def tiny_image_modules(cls, cfg: TinyHunyuanVideo15Config) -> dict:
        """A one-layer random SigLIP vision tower `image_embed_dim` wide over 28 px inputs (4
        patches of 14 px: 4 image-stream tokens) and its image processor."""
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        width = cfg.image_embed_dim
        encoder = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14,
            )
        ).eval()  # fmt: skip
        return {
            "image_encoder": encoder,
            "feature_extractor": SiglipImageProcessor(size={"height": 28, "width": 28}),
        }


def load_checkpoint(
    path: str, num_frames: int, dtype: torch.dtype = torch.float32
) -> HunyuanVideo15I2VBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory (an I2V base)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from unirl.models.flow.loading import load_diffusers_checkpoint

    return load_diffusers_checkpoint(
        path,
        lambda base: HunyuanVideo15I2VBundle.from_pretrained(base, num_frames, dtype=dtype),
        HunyuanVideo15Transformer3DModel,
    )
