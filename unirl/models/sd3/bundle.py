"""The SD3 family: the diffusers / transformers components of one SD3 model, as a `FlowFamily`
(`unirl.models.flow.family`) the shared `FlowMatchingStage` samples and replays.

Two ways to build one (`unirl.models.sd3.config.SD3ModelConfig`), same code path afterwards:
`SD3Bundle.from_pretrained(<dir>)`, a real SD3 / SD3.5 directory (diffusers layout:
transformer/, vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/), or `SD3Bundle.tiny(TinySD3Config)`,
a tiny random model built from configs, tokenizers built in code (no files, no hub); in
`pixel_space` there is no VAE (a random tiny VAE decodes to nearly the same image whatever the
latent).

The sigma schedule is not read from the directory's `scheduler/scheduler_config.json`:
`sampling.shift` / `sampling.dynamic_shift` (and its mu line) are the schedule
of record, computed by `unirl.sde.schedules` exactly as that scheduler's
`set_timesteps` would with those values. To sample as diffusers' pipeline does,
set them to the file's `shift` / `use_dynamic_shifting` (SD3 and SD3.5: shift
3.0, static). Scheduler options those schedules do not reproduce are refused
on load.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)

from unirl.models.flow.family import DiffusersBundle
from unirl.models.flow.guidance import ClassifierFreeGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_autoencoder_kl,
    tiny_clip_t5_text,
    vae_pixels,
)
from unirl.models.sd3.attention import prepare_transformer
from unirl.models.sd3.config import TinySD3Config


class SD3Bundle(DiffusersBundle, ClassifierFreeGuidance):
    """The modules of one SD3 model plus the diffusers pipeline that owns them.

    Attributes:
        pipeline: a `StableDiffusion3Pipeline` (vae may be None in pixel space);
            its `encode_prompt` is the prompt encoder of record.
        transformer: the `SD3Transformer2DModel` (the trainable module), with the Ulysses plan
            and attention processor of `unirl.models.sd3.attention` (inactive until applied).
        vae: `AutoencoderKL` or None (pixel space).
        latent_channels, vae_scale_factor, patch_size: geometry of the latent grid.
        cond_keys: `encode_text`'s conditioning keys (`FlowFamily.cond_keys`).
        guidance: "cfg": classifier-free guidance, the stage batches the uncond branch.
    """

    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    LORA_PIPELINE: ClassVar[type] = StableDiffusion3Pipeline  # reads write_weights' LoRA
    # the prompt encoders: CLIP-L, CLIP-G and T5, in `encode_prompt`'s order
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def __init__(self, pipeline: StableDiffusion3Pipeline) -> None:
        self.pipeline = pipeline
        self.transformer: SD3Transformer2DModel = prepare_transformer(pipeline.transformer)
        self.vae: AutoencoderKL | None = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels
        self.patch_size = self.transformer.config.patch_size
        self.vae_scale_factor = (
            2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        )
        self.freeze_frozen_modules()

    @property
    def sample_size(self) -> int:
        """The image side in pixels the transformer is built for (its config's `sample_size`
        latent cells times the VAE scale)."""
        return self.transformer.config.sample_size * self.vae_scale_factor

    @property
    def pixel_space(self) -> bool:
        return self.vae is None

    def image_seq_len(self, height: int, width: int) -> int:
        """Number of image tokens the transformer sees at this resolution."""
        cell = self.vae_scale_factor * self.patch_size
        return (height // cell) * (width // cell)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        cell = self.vae_scale_factor * self.patch_size
        if height % cell or width % cell:
            raise ValueError(
                f"sampling.height/width ({height}x{width}) must be multiples of {cell} "
                f"(vae scale {self.vae_scale_factor} x patch {self.patch_size})"
            )
        return self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor

    def model_info(self) -> dict:
        """The latent grid's geometry: `pixel_space`, `vae_scale_factor`, `patch_size`."""
        return {
            "pixel_space": self.pixel_space,
            "vae_scale_factor": self.vae_scale_factor,
            "patch_size": self.patch_size,
        }

    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`StableDiffusion3Pipeline.encode_prompt` of `prompts` (CLIP x2 + T5): prompt_embeds
        [U, L, D] (CLIP and T5 tokens joined) and pooled_prompt_embeds [U, P] (the two CLIP
        pooled outputs), plus their "negative_" twins of the empty prompt when `guided`; the
        T5 budget is `max_sequence_length` tokens."""
        pe, npe, pp, npp = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=guided,
            max_sequence_length=max_sequence_length,
        )
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": pp}
        if guided:
            cond["negative_prompt_embeds"] = npe
            cond["negative_pooled_prompt_embeds"] = npp
        return cond

    @staticmethod
    def predict(module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
        """The SD3 transformer's velocity [B, C, h, w] at x [B, C, h, w] and sigma [B]; SD3
        timesteps are `sigma * 1000`; inputs cast to the module's dtype."""
        dtype = next(module.parameters()).dtype
        return module(
            hidden_states=x.to(dtype),
            timestep=sigma * 1000.0,
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped) from latents, differentiable: the
        VAE decode of latents / scaling_factor + shift_factor, or the latents in pixel space."""
        return vae_pixels(self.vae, latents)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> SD3Bundle:
        """Load a local diffusers SD3 directory; a missing vae/ means pixel space."""
        extra = pretrained_pipeline_options(path)
        pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=dtype, **extra)
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.transformer.to(torch.float32)
        return cls(pipe)

    @classmethod
    def tiny(cls, cfg: TinySD3Config) -> SD3Bundle:
        """A randomly initialized tiny SD3, deterministic in `cfg.seed`."""
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        torch.manual_seed(cfg.seed)
        clip_tok, t5_tok, clip_cfg, t5_cfg = tiny_clip_t5_text(
            cfg, t5_max_length=77, t5_heads=4, projection_dim=cfg.clip_hidden_size
        )
        vae = None
        if not cfg.pixel_space:
            vae = tiny_autoencoder_kl(
                cfg.vae_downsample,
                cfg.latent_channels,
                in_channels=3,
                out_channels=3,
                shift_factor=0.0,
                scaling_factor=1.0,
            )
        transformer = cls.tiny_transformer(cfg)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=CLIPTextModelWithProjection(clip_cfg),
            tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(clip_cfg),
            tokenizer_2=clip_tok,
            text_encoder_3=T5EncoderModel(t5_cfg),
            tokenizer_3=t5_tok,
        )
        return cls(pipe)

    @staticmethod
    def tiny_transformer(cfg: TinySD3Config) -> SD3Transformer2DModel:
        """The denoiser alone (3 pixel channels, or `latent_channels` under the VAE)."""
        down = 1 if cfg.pixel_space else cfg.vae_downsample
        channels = 3 if cfg.pixel_space else cfg.latent_channels
        return SD3Transformer2DModel(
            sample_size=cfg.resolution // down,
            patch_size=cfg.patch_size,
            in_channels=channels,
            out_channels=channels,
            num_layers=cfg.num_layers,
            attention_head_dim=cfg.attention_head_dim,
            num_attention_heads=cfg.num_attention_heads,
            joint_attention_dim=cfg.t5_hidden_size,
            caption_projection_dim=cfg.attention_head_dim * cfg.num_attention_heads,
            pooled_projection_dim=2 * cfg.clip_hidden_size,
            pos_embed_max_size=cfg.pos_embed_max_size or cfg.resolution // down // cfg.patch_size,
            qk_norm=cfg.qk_norm,
            dual_attention_layers=tuple(cfg.dual_attention_layers),
        )


tiny_transformer = SD3Bundle.tiny_transformer  # the tiny denoiser, for `SD3ModelConfig.trainable_on_meta`


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> SD3Bundle:
    """Load a bundle with the trained weights of a UniRL checkpoint directory.

    Reads `unirl_checkpoint.json` (written by the train backend), loads its
    `base_model` directory, then applies the weights: the LoRA file through
    diffusers' `load_lora_weights`, or a full `transformer/` directory
    (`unirl.models.flow.loading.load_diffusers_checkpoint`).
    """
    return load_diffusers_checkpoint(
        path, lambda base: SD3Bundle.from_pretrained(base, dtype=dtype), SD3Transformer2DModel
    )
