"""The SD3 family: the diffusers / transformers components of one SD3 model, as a `FlowFamily`
(`unirl.models.flow.family`) the shared `FlowMatchingStage` samples and replays.

Two ways to build one, same code path afterwards:
- `SD3ModelConfig(pretrained_path=<dir>)`: a real SD3 / SD3.5 directory
  (diffusers layout: transformer/, vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/).
- `SD3ModelConfig(tiny=TinySD3Config(...))`: a tiny random model built from
  configs, tokenizers built in code (no files, no hub). `pixel_space=True`
  drops the VAE: the transformer denoises RGB pixels in [-1, 1] directly,
  so image rewards respond to the policy (a random tiny VAE decodes to
  nearly the same image whatever the latent).

The sigma schedule is not read from the directory's `scheduler/scheduler_config.json`:
`sampling.shift` / `sampling.dynamic_shift` (and its mu line) are the schedule
of record, computed by `unirl.sde.schedules` exactly as that scheduler's
`set_timesteps` would with those values. To sample as diffusers' pipeline does,
set them to the file's `shift` / `use_dynamic_shifting` (SD3 and SD3.5: shift
3.0, static). Scheduler options those schedules do not reproduce are refused
on load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)

from unirl.models.flow.config import check_vae_downsample, transformer_on_meta
from unirl.models.flow.family import DiffusersBundle
from unirl.models.flow.guidance import ClassifierFreeGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pipeline_directory_problems,
    pretrained_pipeline_options,
    tiny_autoencoder_kl,
    tiny_clip_t5_text,
    vae_pixels,
)
from unirl.models.source import DTYPES, DType, check_source
from unirl.types.constraints import AtLeastOne, check_fields


@dataclass
class TinySD3Config:
    """A tiny SD3-architecture model for CPU runs and tests.

    `resolution` is the image size in pixels. In pixel space the transformer
    sees [B, 3, resolution, resolution]; otherwise a small random AutoencoderKL
    with a `vae_downsample`x downsample (a power of 2) gives `latent_channels`
    latents. `qk_norm`, `dual_attention_layers` and `pos_embed_max_size` (null:
    the latent grid) are SD3.5's transformer options, so the same config builds an SD3.5-sized denoiser with random
    weights (see `examples/diffusion/sd35m_random_flowgrpo.yaml`). `clip_max_length` is the CLIP
    token budget (SD3 uses 77; a smaller one makes tiny runs faster).
    `words` become whole-word tokens of the tiny CLIP (BPE merges) and T5
    (unigram pieces) tokenizers, which are otherwise character-level: a small
    text encoder learns words far more easily, and prompts get much shorter.
    """

    resolution: AtLeastOne = 32
    pixel_space: bool = True
    patch_size: AtLeastOne = 2
    num_layers: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 32
    num_attention_heads: AtLeastOne = 4
    clip_hidden_size: AtLeastOne = 32
    t5_hidden_size: AtLeastOne = 64
    text_layers: AtLeastOne = 2
    clip_max_length: AtLeastOne = 77
    words: list[str] = field(default_factory=list)
    seed: int = 0
    latent_channels: AtLeastOne = 4
    vae_downsample: int = 2
    qk_norm: str | None = None
    dual_attention_layers: list[int] = field(default_factory=list)
    pos_embed_max_size: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "model.tiny.")
        check_vae_downsample(self.vae_downsample)
        if self.qk_norm not in (None, "rms_norm", "layer_norm"):
            raise ValueError(f"model.tiny.qk_norm must be null, rms_norm or layer_norm, got {self.qk_norm!r}")
        grid = self.resolution // (1 if self.pixel_space else self.vae_downsample) // self.patch_size
        if self.pos_embed_max_size is not None and self.pos_embed_max_size < grid:
            raise ValueError(
                f"model.tiny.pos_embed_max_size={self.pos_embed_max_size} is smaller than the latent grid "
                f"({grid} patches per side); leave it null to use the grid"
            )
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"model.tiny.dual_attention_layers {bad} are not layer indices in [0, {self.num_layers})"
            )
        cell = (1 if self.pixel_space else self.vae_downsample) * self.patch_size
        if self.resolution % cell:
            raise ValueError(
                f"model.tiny.resolution={self.resolution} must be a multiple of {cell} "
                f"(patch_size {self.patch_size}{'' if self.pixel_space else f' x vae_downsample {self.vae_downsample}'})"
            )
        if self.clip_hidden_size % 2:
            raise ValueError(
                f"model.tiny.clip_hidden_size must be even (2 CLIP attention heads), got {self.clip_hidden_size}"
            )


@dataclass
class SD3ModelConfig:
    """Which SD3 model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a real SD3 / SD3.5 model.
        tiny: tiny-model config used when `pretrained_path` is null.
        dtype: parameter dtype of the frozen components ("float32",
            "bfloat16", "float16"); the trainable transformer stays fp32
            master weights unless the backend casts it.
    """

    modality: ClassVar[str] = "diffusion"

    pretrained_path: str | None = None
    tiny: TinySD3Config | None = field(default_factory=TinySD3Config)
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_source(self, TinySD3Config, "SD3")

    def trainable_on_meta(self) -> torch.nn.Module:
        """The denoiser's module tree on the meta device (no weights read): for
        validators that check names against the model before any work starts."""
        return transformer_on_meta(
            SD3Transformer2DModel, self.pretrained_path, lambda: SD3Bundle.tiny_transformer(self.tiny)
        )

    def build(self) -> SD3Bundle:
        if self.pretrained_path:
            return SD3Bundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return SD3Bundle.tiny(self.tiny)

    def load_checkpoint(self, path: str) -> SD3Bundle:
        """The bundle of a UniRL checkpoint of an SD3 run, fp32 (`load_checkpoint`)."""
        return load_checkpoint(path)

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a diffusers SD3 directory (its `model_index.json`, if
        any, names `StableDiffusion3Pipeline`)."""
        return pipeline_directory_problems(
            self.pretrained_path, StableDiffusion3Pipeline.__name__, "SD3 / SD3.5"
        )

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """height / width vs the latent patch grid (vae scale x patch size pixels per token) and,
        for a tiny model, its position embedding (at most `tiny.resolution`); the messages name
        `{key}.height` / `{key}.width`."""
        geometry = self._geometry()
        if geometry is None:
            return []
        cell, largest = geometry
        problems = []
        for side, value in (("height", height), ("width", width)):
            if value % cell:
                problems.append(
                    f"{key}.{side}={value} must be a multiple of {cell}, the pixels per latent patch of the model"
                )
            if largest is not None and value > largest:
                problems.append(
                    f"{key}.{side}={value} exceeds model.tiny.resolution={largest}, the largest size "
                    "the tiny model's position embedding covers"
                )
        return problems

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """None: SD3 takes any classifier-free guidance scale >= 1 (the sampling params' own check)."""
        return []

    def _geometry(self) -> tuple[int, int | None] | None:
        """(pixels per latent patch, largest height/width or None), None when unreadable."""
        if not self.pretrained_path:
            tiny = self.tiny
            return (1 if tiny.pixel_space else tiny.vae_downsample) * tiny.patch_size, tiny.resolution
        try:
            with open(os.path.join(self.pretrained_path, "transformer", "config.json")) as f:
                patch = json.load(f)["patch_size"]
            vae_config = os.path.join(self.pretrained_path, "vae", "config.json")
            scale = 1
            if os.path.exists(vae_config):
                with open(vae_config) as f:
                    scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
        except (OSError, KeyError, ValueError):
            return None  # an unreadable model directory is reported by directory_problems / the load
        return scale * patch, None


class SD3Bundle(DiffusersBundle, ClassifierFreeGuidance):
    """The modules of one SD3 model plus the diffusers pipeline that owns them.

    Attributes:
        pipeline: a `StableDiffusion3Pipeline` (vae may be None in pixel space);
            its `encode_prompt` is the prompt encoder of record.
        transformer: the `SD3Transformer2DModel` (the trainable module).
        vae: `AutoencoderKL` or None (pixel space).
        latent_channels, vae_scale_factor, patch_size: geometry of the latent grid.
        cond_keys: `encode_text`'s conditioning keys (`FlowFamily.cond_keys`).
        guidance: "cfg": classifier-free guidance, the stage batches the uncond branch.
    """

    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    LORA_PIPELINE: ClassVar[type] = StableDiffusion3Pipeline  # reads write_weights' LoRA

    def __init__(self, pipeline: StableDiffusion3Pipeline) -> None:
        self.pipeline = pipeline
        self.transformer: SD3Transformer2DModel = pipeline.transformer
        self.vae: AutoencoderKL | None = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels
        self.patch_size = self.transformer.config.patch_size
        self.vae_scale_factor = (
            2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        )
        self.freeze_frozen_modules()

    def text_encoders(self) -> list[torch.nn.Module]:
        """CLIP-L, CLIP-G and T5, in `encode_prompt`'s order."""
        p = self.pipeline
        return [m for m in (p.text_encoder, p.text_encoder_2, p.text_encoder_3) if m is not None]

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
