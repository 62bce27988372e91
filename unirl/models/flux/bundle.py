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

import json
import os
from typing import ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from unirl.models.flow.guidance import EmbeddedGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    tiny_clip_t5_tokenizers,
    vae_pixels,
    write_diffusers_weights,
)
from unirl.models.flow.packing import Packed2x2Bundle
from unirl.models.flux.config import TinyFluxConfig


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C]: each 2x2 cell one token (FluxPipeline's packing)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w], the inverse of `pack`."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


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
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()

    @property
    def denoiser(self) -> FluxTransformer2DModel:
        return self.transformer

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale (FLUX.1-dev) or none (FLUX.1-schnell)."""
        return bool(self.transformer.config.guidance_embeds)

    def text_encoders(self) -> list[torch.nn.Module]:
        """CLIP (pooled output) and T5, in `encode_prompt`'s order."""
        return [self.pipeline.text_encoder, self.pipeline.text_encoder_2]

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
        if self.guidance_embeds and guidance is None:
            raise ValueError("this FLUX transformer embeds the guidance scale: predict needs guidance [B]")
        if not self.guidance_embeds:
            if guidance is not None and bool((guidance != 1.0).any()):
                raise ValueError(
                    "this FLUX transformer has no guidance embedding (guidance_embeds false): "
                    "sampling.guidance_scale must be 1.0"
                )
            guidance = None
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
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model.pretrained_path {path!r} is not a directory")
        extra = {} if os.path.isdir(os.path.join(path, "vae")) else {"vae": None}
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype, **extra)
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.transformer.to(torch.float32)
        scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1) if pipe.vae is not None else 1
        return cls(pipe, sample_size=pipe.default_sample_size * scale)

    @classmethod
    def tiny(cls, cfg: TinyFluxConfig) -> FluxBundle:
        """A randomly initialized tiny FLUX.1, deterministic in `cfg.seed`."""
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        torch.manual_seed(cfg.seed)
        clip_tok, t5_tok = tiny_clip_t5_tokenizers(cfg.clip_max_length, t5_max_length=512, words=cfg.words)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tok.get_vocab()),
                hidden_size=cfg.clip_hidden_size,
                intermediate_size=2 * cfg.clip_hidden_size,
                num_hidden_layers=cfg.text_layers,
                num_attention_heads=2,
                max_position_embeddings=cfg.clip_max_length,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tok.get_vocab()),
                d_model=cfg.t5_hidden_size,
                d_ff=2 * cfg.t5_hidden_size,
                d_kv=16,
                num_layers=cfg.text_layers,
                num_heads=2,
                decoder_start_token_id=0,
            )
        )
        vae = None
        if not cfg.pixel_space:
            levels = cfg.vae_downsample.bit_length()  # 2 -> 2 blocks (one downsample), 8 -> 4 blocks
            vae = AutoencoderKL(
                down_block_types=("DownEncoderBlock2D",) * levels,
                up_block_types=("UpDecoderBlock2D",) * levels,
                block_out_channels=(16,) + (32,) * (levels - 1),
                latent_channels=cfg.latent_channels,
                norm_num_groups=8,
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

    def save_pretrained(self, path: str) -> None:
        """The diffusers layout `from_pretrained` (and `FluxPipeline.from_pretrained`) reads."""
        self.pipeline.save_pretrained(path)

    @staticmethod
    def write_weights(path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
        """The train backend's exporter: a LoRA as `pytorch_lora_weights.safetensors` with its
        adapter config (alpha) in the metadata, what `FluxPipeline.load_lora_weights` reads; a
        full state as a `transformer/` directory."""
        write_diffusers_weights(FluxPipeline, path, kind, state, module)


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


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, bundle_class: type = FluxBundle) -> FluxBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` (from
    `unirl_checkpoint.json`) with the LoRA loaded by `FluxPipeline.load_lora_weights`, or the
    full `transformer/` directory."""
    meta_path = os.path.join(path, "unirl_checkpoint.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path!r} is not a UniRL checkpoint: {meta_path} is missing")
    with open(meta_path) as f:
        meta = json.load(f)
    bundle = bundle_class.from_pretrained(meta["base_model"], dtype=dtype)
    if meta["kind"] == "lora":
        bundle.pipeline.load_lora_weights(path)
    else:
        transformer = FluxTransformer2DModel.from_pretrained(os.path.join(path, "transformer"))
        bundle.pipeline.transformer = bundle.transformer = transformer
    return bundle
