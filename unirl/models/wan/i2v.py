"""Wan 2.2 image-to-video: Wan that animates each row's first frame (`WanImageToVideoPipeline`
without an image encoder, the Wan 2.2 I2V-A14B layout: two experts switched at `boundary_ratio`
0.9, or one transformer).

The same text encoder, VAE, guidance and experts as Wan T2V (`bundle.py`, `experts.py`); what
differs is the condition. Each prompt row names its first frame, or its first and last frames
(`metadata[condition_key]`, a list of one or two images: files resolved against the prompt file,
arrays or PIL images; the pipeline's `image` and `last_image`). Once per request
(`encode_conditions`) each row's frames are resized to the sampled size and encoded as the
pipeline's `prepare_latents` does it (called here, so the arithmetic is the pipeline's): the first
frame followed by black frames (and the last frame, when given) through the VAE (its mode,
normalised by the latents' mean / std), behind a mask of `temporal` channels that marks the given
frames' latents.
That `condition` [B, temporal + C, f, h, w] rides with the track; every network call concatenates
it after the noisy latents along the channels (the transformer takes 2C + temporal channels in, C
out), and both CFG branches read it (`shared_keys`).

Not built: Wan 2.1 I2V (its transformer also reads CLIP image embeddings, `image_dim`), Wan 2.2
TI2V-5B (`expand_timesteps`: per-token timesteps). A model of those is refused when built. Pixel space cannot run (the condition is VAE latents).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

from unirl.models.images import load_image
from unirl.models.wan import bundle as wan
from unirl.models.wan.bundle import WanBundle
from unirl.models.wan.config import TinyWanConfig
from unirl.types import RolloutReq

CONDITION_KEY = "images"
"""The default prompt-row metadata key naming a sample's first frame (and last frame)."""
FRAMES_NEED = "Wan I2V animates one first frame, or a first and a last frame"


class WanI2VBundle(WanBundle):
    """A Wan 2.2 I2V model: `WanBundle` over a `WanImageToVideoPipeline`, conditioned on each
    sample's row's first frame (`cond_keys` adds `condition`).

    """

    cond_keys = ("prompt_embeds", "condition")
    shared_keys = ("condition",)
    LORA_PIPELINE: ClassVar[type] = WanImageToVideoPipeline
    PIPELINE: ClassVar[type] = WanImageToVideoPipeline
    condition_key: str = CONDITION_KEY  # the metadata key of a row's first frame (set by the config)

    def __init__(
        self,
        pipeline: WanImageToVideoPipeline,
        num_frames: int,
        sample_size: int,
        any_size: bool = False,
    ) -> None:
        transformer = pipeline.transformer
        if pipeline.vae is None:
            raise ValueError(
                "Wan I2V encodes its first frame with the VAE: a pixel-space model cannot take it (set "
                "model.tiny.pixel_space: false)"
            )
        if transformer.config.image_dim is not None or pipeline.config.get("expand_timesteps"):
            raise ValueError(
                "this Wan I2V model reads CLIP image embeddings (Wan 2.1 I2V: transformer image_dim) or per-token "
                "timesteps (Wan 2.2 TI2V-5B: expand_timesteps), which UniRL does not build; Wan 2.2 I2V-A14B's "
                "layout (no image encoder) is"
            )
        super().__init__(pipeline, num_frames, sample_size, any_size)

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq, guided: bool) -> dict[str, torch.Tensor]:
        """{"condition": [B, temporal + C, f, h, w] fp32}: each row's first frame (and last frame:
        one or two images under `condition_key`; the samples of a group share their row's, encoded
        once) resized to the sampled size, VAE-encoded behind the given-frame mask by the
        pipeline's own `prepare_latents`. `guided` changes nothing (both branches read it). Errors
        name the sample."""
        sp = req.sampling
        rows = {
            group: self._encode_frame(req.metadata[i], req.sample_ids[i], sp.height, sp.width)
            for group, i in req.group_firsts().items()
        }
        return {"condition": torch.cat([rows[g] for g in req.group_ids])}

    def _encode_frame(
        self, metadata: dict[str, Any], sample_id: str, height: int, width: int
    ) -> torch.Tensor:
        entries = metadata.get(self.condition_key)
        if not isinstance(entries, list | tuple) or len(entries) not in (1, 2):
            got = "none" if not entries else f"{len(entries)}"
            raise ValueError(
                f"sample {sample_id!r}: {FRAMES_NEED} (metadata {self.condition_key!r}: a list of one or two "
                f"images), got {got}"
            )
        if len(entries) == 2 and self.num_frames < 3:
            raise ValueError(
                f"sample {sample_id!r} gives a first and a last frame, but model.num_frames={self.num_frames} has no "
                "frame between them: give 5 or more frames"
            )
        pipe = self.pipeline
        first, *last = (
            pipe.video_processor.preprocess(load_image(entry, sample_id, i), height=height, width=width).to(
                self.device, torch.float32
            )
            for i, entry in enumerate(entries)
        )
        shape = (1, *self.latent_shape(height, width))
        _, condition = pipe.prepare_latents(
            first, 1, self.latent_channels, height, width, self.num_frames, torch.float32, self.device, None,
            latents=torch.zeros(shape, device=self.device), last_image=last[0] if last else None,
        )  # fmt: skip
        return condition.float()

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """Velocity [B, C, f, h, w]: Wan's `predict` of the noisy latents with the row's
        `condition` concatenated after them along the channels."""
        return super().predict(module, torch.cat([x, cond["condition"].to(x.dtype)], dim=1), sigma, cond)

    @staticmethod
    def tiny_denoiser(cfg: TinyWanConfig) -> WanTransformer3DModel:
        """`tiny_transformer`."""
        return tiny_transformer(cfg)

    @classmethod
    def tiny_modules(cls, cfg: TinyWanConfig) -> dict:
        """Wan's tiny modules with no image encoder (the Wan 2.2 I2V-A14B layout)."""
        return {**super().tiny_modules(cfg), "image_encoder": None, "image_processor": None}


def tiny_transformer(cfg: TinyWanConfig) -> WanTransformer3DModel:
    """The tiny I2V denoiser: Wan's tiny transformer taking the latents, the first-frame mask
    (`vae_temporal` channels) and the frame's latents (2C + temporal channels), giving C."""
    return wan.tiny_transformer(cfg, condition_channels=cfg.vae_temporal + cfg.latent_channels)


def load_checkpoint(path: str, num_frames: int, dtype: torch.dtype = torch.float32) -> WanI2VBundle:
    """The bundle of a UniRL checkpoint of an I2V run (Wan's `load_checkpoint` into this bundle)."""
    return wan.load_checkpoint(path, num_frames, dtype, bundle_class=WanI2VBundle)
