"""The Wan 2.1 text-to-video family: diffusers' `WanTransformer3DModel` with a UMT5 prompt encoder
and the causal video VAE `AutoencoderKLWan`, as a `FlowFamily` (`unirl.models.flow.family`) the
shared `FlowMatchingStage` samples and replays.

What differs from the image families, all inside this file:
- latents are videos [B, C, f, h, w] (f latent frames: (num_frames - 1) / temporal + 1), the
  transformer's own layout (it patches (1, 2, 2) and places rotary positions on frames, rows and
  columns itself); the stage, the SDE and every algorithm treat them as any latent tensor;
- guidance is classifier-free as Wan does it: the uncond branch is the empty prompt's UMT5
  embedding (WanPipeline's default negative prompt), v_u + s (v_c - v_u);
- the transformer's timestep is `sigma * 1000` (the Euler scheduler's timesteps);
- decode is the VAE of `latents * latents_std + latents_mean` (per channel, written as
  WanPipeline writes it) and gives frames [B, F, 3, H, W].

The sigma schedule is the recipe's: Wan 2.1 samples with `linspace(1, 1/T, T)` shifted by its
`flow_shift` (3.0 at 480p), i.e. `sampling.sigma_grid: steps`, `sampling.shift: 3.0`, no dynamic
shift. A real directory ships a UniPC multistep scheduler; the stage's ODE is Euler, so the bundle
builds its pipeline with `FlowMatchEulerDiscreteScheduler(shift=flow_shift)`, which `WanPipeline`
accepts and which is what parity is checked against.
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from unirl.models.flow.guidance import ClassifierFreeGuidance
from unirl.models.flow.loading import (
    latents_mean_std_decode,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_causal_vae,
    tiny_clip_t5_tokenizers,
    tiny_t5_config,
    write_diffusers_weights,
)
from unirl.models.flow.packing import VideoClipBundle
from unirl.models.source import read_checkpoint_meta
from unirl.models.wan.config import PATCH, TinyWanConfig
from unirl.models.wan.experts import EXPERTS, WanExperts, expert_states
from unirl.sde.schedules import NUM_TRAIN_TIMESTEPS


class WanBundle(VideoClipBundle, ClassifierFreeGuidance):
    """The modules of one Wan 2.1 or 2.2 T2V model plus the `WanPipeline` that owns them.

    Attributes:
        pipeline: a `WanPipeline` (vae None in pixel space); its `encode_prompt` is the prompt
            encoder of record.
        transformer: the trainable module: the `WanTransformer3DModel`, or, when the pipeline has
            a `transformer_2` and a `boundary_ratio` (Wan 2.2 A14B), both experts as one
            `WanExperts` (`unirl.models.wan.experts`).
        vae: `AutoencoderKLWan` or None (pixel space).
        num_frames: frames per video (the latent clip has (num_frames - 1) / temporal + 1).
        temporal, spatial: the VAE's compression along time and along each side (1, 1 in pixel
            space).
        sample_size: the frame side in pixels (a tiny model's resolution; 480 for a directory,
            Wan 2.1 1.3B's trained size).
        any_size: True for a directory: it does not record the frame size it was trained at, and
            Wan's rotary embedding takes any size, so it samples any side the VAE and the 2x2
            patch divide; False for a tiny model, which takes its `resolution`.
        cond_keys: `encode_text`'s keys. guidance: "cfg".
    """

    cond_keys = ("prompt_embeds",)
    LORA_PIPELINE: ClassVar[type] = WanPipeline  # reads write_weights' LoRA
    guidance_scale_2: float | None = None  # the low-noise expert's CFG scale (set by the config)
    PIPELINE: ClassVar[type] = WanPipeline  # the diffusers pipeline class this bundle owns
    patch: ClassVar[int] = PATCH[1]  # the 2x2 spatial patch a token takes

    def __init__(
        self, pipeline: WanPipeline, num_frames: int, sample_size: int, any_size: bool = False
    ) -> None:
        self.pipeline = pipeline
        self.any_size = any_size
        self.transformer: WanTransformer3DModel | WanExperts = experts_of(pipeline)
        self.vae: AutoencoderKLWan | None = pipeline.vae
        self.latent_channels = pipeline.transformer.config.out_channels
        temporal, spatial = (
            (1, 1)
            if self.vae is None
            else (int(self.vae.config.scale_factor_temporal), int(self.vae.config.scale_factor_spatial))
        )
        self.set_clip(num_frames, sample_size, temporal, spatial, "this Wan VAE")

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`WanPipeline.encode_prompt`: prompt_embeds [U, L, D] (UMT5, zero past each prompt's
        tokens, L = max_sequence_length); with `guided` negative_prompt_embeds, the empty
        prompt's (the pipeline's default negative prompt)."""
        pe, neg = self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=guided,
            max_sequence_length=max_sequence_length,
            device=self.device,
        )
        out = {"prompt_embeds": pe}
        if guided:
            out["negative_prompt_embeds"] = neg
        return out

    def row_scales(self, sigma: torch.Tensor, scale: float) -> float | torch.Tensor:
        """With two experts and `guidance_scale_2`: that scale on the rows the low-noise expert
        denoises (timestep `sigma * 1000` below the boundary, as `WanExperts` routes them), `scale`
        on the rest ([B, 1, 1, 1, 1]; `WanPipeline`'s `guidance_scale_2`); else `scale`."""
        if self.guidance_scale_2 is None or not isinstance(self.transformer, WanExperts):
            return scale
        dtype = next(self.transformer.parameters()).dtype
        low = (sigma * 1000.0).to(dtype) < self.transformer.boundary_timestep
        scales = torch.where(low, self.guidance_scale_2, scale).to(torch.float32)
        return scales.view(-1, 1, 1, 1, 1)

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """Velocity [B, C, f, h, w] at video latents x [B, C, f, h, w] and sigma [B], timestep
        `sigma * 1000`."""
        dtype = next(module.parameters()).dtype
        return module(
            hidden_states=x.to(dtype),
            timestep=(sigma * 1000.0).to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, F, 3, H, W] fp32 RGB frames in about [-1, 1] (unclamped), differentiable: the VAE
        decode of `latents / (1 / latents_std) + latents_mean` (WanPipeline's arithmetic), or the
        latents themselves in pixel space; frames moved before channels."""
        if self.vae is None:
            return latents.float().transpose(1, 2)
        return latents_mean_std_decode(self.vae, latents).float().transpose(1, 2)

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, num_frames: int, dtype: torch.dtype = torch.float32) -> WanBundle:
        """Load a local diffusers directory of `PIPELINE`; a missing vae/ means pixel space. The
        directory's scheduler is replaced by the Euler scheduler at its flow shift (module doc)."""
        extra = pretrained_pipeline_options(path)
        shift = _flow_shift(os.path.join(path, "scheduler", "scheduler_config.json"))
        pipe = cls.PIPELINE.from_pretrained(
            path, torch_dtype=dtype, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), **extra
        )
        if pipe.vae is not None:
            pipe.vae.to(torch.float32)  # Wan's VAE decodes in fp32 (its reference and WanPipeline's)
        for name in EXPERTS:  # fp32 master weights (transformer_2: Wan 2.2 A14B's low-noise expert)
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).to(torch.float32)
        return cls(pipe, num_frames, sample_size=480, any_size=True)

    @classmethod
    def tiny(cls, cfg: TinyWanConfig, num_frames: int) -> WanBundle:
        """A randomly initialized tiny model of `PIPELINE`, deterministic in `cfg.seed`."""
        return cls(cls.PIPELINE(**cls.tiny_modules(cfg)), num_frames, sample_size=cfg.resolution)

    @classmethod
    def tiny_modules(cls, cfg: TinyWanConfig) -> dict:
        """The tiny pipeline's modules: UMT5 and its tokenizer, the VAE (None in pixel space), the
        Euler scheduler, the transformer (`tiny_denoiser`) and, with `cfg.boundary_ratio`, the
        low-noise expert built after it and the boundary."""
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(cfg.seed)
        _, tokenizer = tiny_clip_t5_tokenizers(8, t5_max_length=512, words=cfg.words)
        text_encoder = UMT5EncoderModel(
            tiny_t5_config(UMT5Config, tokenizer, cfg.text_hidden_size, cfg.text_layers, num_heads=2)
        )
        vae = None
        if not cfg.pixel_space:
            levels = cfg.vae_spatial.bit_length() - 1  # spatial downsamples
            temporal = cfg.vae_temporal.bit_length() - 1
            vae = tiny_causal_vae(
                AutoencoderKLWan,
                cfg.vae_base_dim,
                cfg.latent_channels,
                levels,
                num_res_blocks=cfg.vae_res_blocks,
                temperal_downsample=[i >= levels - temporal for i in range(levels)],
                scale_factor_temporal=cfg.vae_temporal,
                scale_factor_spatial=cfg.vae_spatial,
            )
        return dict(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Wan 2.1's flow shift at 480p
            transformer=cls.tiny_denoiser(cfg),
            # Wan 2.2 A14B: the low-noise expert, built after the high-noise one
            transformer_2=cls.tiny_denoiser(cfg) if cfg.boundary_ratio is not None else None,
            boundary_ratio=cfg.boundary_ratio,
        )

    @staticmethod
    def tiny_denoiser(cfg: TinyWanConfig) -> WanTransformer3DModel:
        """The tiny transformer of this model (`tiny_transformer`)."""
        return tiny_transformer(cfg)

    @classmethod
    def write_weights(
        cls, path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module
    ) -> None:
        """`DiffusersBundle.write_weights`; two experts' as two of them: the high-noise expert's
        in `path`, the low-noise one's in `path/transformer_2` (a LoRA there is what
        `WanPipeline.load_lora_weights(..., load_into_transformer_2=True)` reads; a full state
        is `transformer/` and `transformer_2/transformer/`)."""
        if not any(k.startswith(EXPERTS[1] + ".") for k in state):
            return super().write_weights(path, kind, state, module)
        for name, part in expert_states(state).items():
            where = path if name == EXPERTS[0] else os.path.join(path, name)
            write_diffusers_weights(
                cls.LORA_PIPELINE, where, kind, part, getattr(module, name), adapter=module
            )


def _flow_shift(scheduler_config: str) -> float:
    """The directory scheduler's flow shift: UniPC's `flow_shift`, an Euler scheduler's `shift`
    (3.0, Wan 2.1's 480p value, when unreadable)."""
    try:
        with open(scheduler_config) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return 3.0
    return float(config.get("flow_shift") or config.get("shift") or 3.0)


def tiny_transformer(cfg: TinyWanConfig, condition_channels: int = 0) -> WanTransformer3DModel:
    """The denoiser alone: 3 pixel channels, or `latent_channels`, out, patch (1, 2, 2); in, those
    plus `condition_channels` (an I2V model's first-frame mask and latents)."""
    channels = 3 if cfg.pixel_space else cfg.latent_channels
    return WanTransformer3DModel(
        patch_size=PATCH,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=channels + condition_channels,
        out_channels=channels,
        text_dim=cfg.text_hidden_size,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        rope_max_seq_len=1024,
    )


def load_checkpoint(
    path: str, num_frames: int, dtype: torch.dtype = torch.float32, bundle_class: type = WanBundle
) -> WanBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` (from
    `unirl_checkpoint.json`) with the LoRA loaded by `WanPipeline.load_lora_weights`, or the full
    `transformer/` directory (`unirl.models.flow.loading.load_diffusers_checkpoint`); for two
    experts also the low-noise expert's, from `transformer_2/` (`WanBundle.write_weights`)."""
    bundle = load_diffusers_checkpoint(
        path,
        lambda base: bundle_class.from_pretrained(base, num_frames, dtype=dtype),
        WanTransformer3DModel,
    )
    low = os.path.join(path, EXPERTS[1])
    if isinstance(bundle.transformer, WanExperts) or os.path.isdir(low):
        pipe = bundle.pipeline
        if read_checkpoint_meta(path)["kind"] == "lora":
            pipe.load_lora_weights(low, load_into_transformer_2=True)
        else:
            pipe.transformer_2 = WanTransformer3DModel.from_pretrained(os.path.join(low, "transformer"))
        bundle.transformer = experts_of(pipe)  # the full load replaced the pipeline's modules
    return bundle


def experts_of(pipeline: WanPipeline) -> WanTransformer3DModel | WanExperts:
    """The trainable module of a pipeline: its transformer, or with a `transformer_2` and a
    `boundary_ratio` both experts as one `WanExperts` (a `transformer_2` without a boundary is an
    error naming the directory's setting)."""
    low, ratio = getattr(pipeline, "transformer_2", None), pipeline.config.get("boundary_ratio")
    if low is None:
        return pipeline.transformer
    if ratio is None:
        raise ValueError(
            "this Wan pipeline has a transformer_2 (Wan 2.2's low-noise expert) but no boundary_ratio: "
            "set boundary_ratio in its model_index.json (Wan 2.2 T2V: 0.875, I2V: 0.9)"
        )
    return WanExperts(pipeline.transformer, low, ratio * NUM_TRAIN_TIMESTEPS)
