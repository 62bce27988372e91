"""The FLUX.1 family: diffusers' `FluxTransformer2DModel` with CLIP (pooled) + T5 prompt
encoders and an AutoencoderKL, as a `FlowFamily` (`unirl.models.flow.family`) the shared
`FlowMatchingStage` samples and replays.

What differs from SD3, all inside this file:
- latents [B, C, h, w] (h, w even) are packed 2x2 into tokens [B, h/2 * w/2, 4C] for the
  network and unpacked after, with the latent image ids (0, row, col) of the packed grid and
  zero text ids, as `FluxPipeline` does; the stage's latents stay [B, C, h, w], so every
  algorithm and the SDE see the same shapes as for any other family;
- guidance is "embedded": FLUX.1-dev is guidance-distilled, the scale (3.5 by default) is a
  network input and there is no uncond branch (no true CFG here);
- the transformer's timestep is `(sigma * 1000) / 1000` (the pipeline's arithmetic);
- decode is the VAE of `latents / scaling_factor + shift_factor`.

The sigma schedule is the recipe's (`sampling.sigma_grid: steps`, `sampling.dynamic_shift: true`
is what `FluxPipeline` samples with; mu from the packed token count).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from unirl.models.flow.guidance import EmbeddedGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_autoencoder_kl,
    tiny_clip_t5_text,
    vae_pixels,
)
from unirl.models.flow.packing import Packed2x2Bundle, pack, unpack
from unirl.models.flux.config import TinyFluxConfig


def image_ids(rows: int, cols: int) -> torch.Tensor:
    """[rows * cols, 3] fp32 position ids (0, row, col) of the packed token grid."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


class FluxBundle(Packed2x2Bundle, EmbeddedGuidance):
    """The modules of one FLUX.1 model plus the `FluxPipeline` that owns them.

    Attributes:
        pipeline: a `FluxPipeline` (vae None in pixel space); its `encode_prompt` is the prompt
            encoder of record.
        transformer: the `FluxTransformer2DModel` (the trainable module).
        vae: `AutoencoderKL` or None (pixel space).
        latent_channels, vae_scale_factor: the latent grid (C = transformer in_channels / 4).
        sample_size: the image side in pixels (a tiny model's resolution; FluxPipeline's default
            1024 for a directory).
        cond_keys: `encode_text`'s keys. guidance: "embedded".
    """

    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    LORA_PIPELINE: ClassVar[type] = FluxPipeline  # reads write_weights' LoRA
    # the prompt encoders: CLIP (pooled output) and T5, in `encode_prompt`'s order
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    PIPELINE: ClassVar[type] = FluxPipeline  # the diffusers pipeline class this bundle owns and saves

    def __init__(self, pipeline: FluxPipeline, sample_size: int) -> None:
        self.pipeline = pipeline
        self.transformer: FluxTransformer2DModel = pipeline.transformer
        self.vae: AutoencoderKL | None = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels // 4
        self.vae_scale_factor = (
            2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        )
        self.sample_size = sample_size
        self.freeze_frozen_modules()

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale (FLUX.1-dev) or none (FLUX.1-schnell)."""
        return bool(self.transformer.config.guidance_embeds)

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`FluxPipeline.encode_prompt`: prompt_embeds [U, L, D] (T5, L = max_sequence_length) and
        pooled_prompt_embeds [U, P] (CLIP's pooled output). FLUX has no uncond branch: `guided`
        must be False (the stage asks an "embedded" family for none)."""
        if guided:
            raise ValueError(
                "the FLUX family runs no classifier-free guidance: it has no uncond branch to encode"
            )
        pe, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=max_sequence_length
        )
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}

    def predict(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: dict,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B]: packed 2x2, with the
        image / text position ids, the timestep `(sigma * 1000) / 1000` and, for a
        guidance-distilled transformer, `guidance` [B] (required then; a transformer without
        a guidance embedding takes only 1.0, i.e. none)."""
        guidance = self.network_guidance(guidance, self.guidance_embeds, "FLUX")
        dtype = next(module.parameters()).dtype
        _, _, h, w = x.shape
        text = cond["prompt_embeds"]
        tokens, ids = self.image_tokens(x, cond)
        out = module(
            hidden_states=tokens.to(dtype),
            timestep=(sigma * 1000.0 / 1000).to(dtype),
            guidance=None if guidance is None else guidance.to(dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=dtype),
            img_ids=ids.to(device=x.device, dtype=dtype),
            return_dict=False,
        )[0]
        return unpack(out[:, : (h // 2) * (w // 2)].contiguous(), h, w)

    def image_tokens(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The image stream the transformer sees: the packed latents [B, N, 4C] and their position
        ids [N, 3]; the velocity is read from the first N output tokens (a conditioned family
        appends its reference tokens after them)."""
        _, _, h, w = x.shape
        return pack(x), image_ids(h // 2, w // 2)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the VAE decode of
        latents / scaling_factor + shift_factor, or the latents in pixel space."""
        return vae_pixels(self.vae, latents)

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> FluxBundle:
        """Load a local diffusers FLUX.1 directory; a missing vae/ means pixel space."""
        extra = pretrained_pipeline_options(path)
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype, **extra)
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.transformer.to(torch.float32)
        scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1) if pipe.vae is not None else 1
        return cls(pipe, sample_size=pipe.default_sample_size * scale)

    @classmethod
    def tiny(cls, cfg: TinyFluxConfig) -> FluxBundle:
        """A randomly initialized tiny FLUX.1, deterministic in `cfg.seed`."""
        from transformers import CLIPTextModel, T5EncoderModel

        torch.manual_seed(cfg.seed)
        clip_tok, t5_tok, clip_cfg, t5_cfg = tiny_clip_t5_text(cfg, t5_max_length=512, t5_heads=2)
        clip = CLIPTextModel(clip_cfg)
        t5 = T5EncoderModel(t5_cfg)
        vae = None
        if not cfg.pixel_space:
            vae = tiny_autoencoder_kl(
                cfg.vae_downsample,
                cfg.latent_channels,
                scaling_factor=cfg.vae_scaling_factor,
                shift_factor=cfg.vae_shift_factor,
                use_quant_conv=False,
                use_post_quant_conv=False,
            )
        pipe = cls.PIPELINE(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),  # FLUX.1-dev's
            vae=vae,
            text_encoder=clip,
            tokenizer=clip_tok,
            text_encoder_2=t5,
            tokenizer_2=t5_tok,
            transformer=tiny_transformer(cfg),
        )
        return cls(pipe, sample_size=cfg.resolution)


def tiny_transformer(cfg: TinyFluxConfig) -> FluxTransformer2DModel:
    """The denoiser alone: 4 x (3 pixel channels, or `latent_channels`) in and out per token."""
    channels = 3 if cfg.pixel_space else cfg.latent_channels
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.t5_hidden_size,
        pooled_projection_dim=cfg.clip_hidden_size,
        guidance_embeds=cfg.guidance_embeds,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
    )


def load_checkpoint(
    path: str, dtype: torch.dtype = torch.float32, bundle_class: type = FluxBundle
) -> FluxBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` (from
    `unirl_checkpoint.json`) with the LoRA loaded by `FluxPipeline.load_lora_weights`, or the
    full `transformer/` directory (`unirl.models.flow.loading.load_diffusers_checkpoint`)."""
    return load_diffusers_checkpoint(
        path, lambda base: bundle_class.from_pretrained(base, dtype=dtype), FluxTransformer2DModel
    )
