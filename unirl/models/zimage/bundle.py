"""The Z-Image family: diffusers' `ZImageTransformer2DModel` (a single-stream DiT) with a Qwen3
prompt encoder and FLUX.1's `AutoencoderKL`, as a `FlowFamily` (`unirl.models.flow.family`) the
shared `FlowMatchingStage` samples and replays.

What differs from the other image families, all inside this file:
- the transformer takes lists: one [C, 1, h, w] latent and one [L_i, D] caption (the prompt's
  real tokens only) per sample, and patchifies 2x2 itself; the stage's latents stay [B, C, h, w]
  and the captions ride padded to `max_sequence_length` with a mask (`prompt_embeds_mask`), cut
  back to their real tokens in `predict`;
- prompts go through Qwen's chat template into the Qwen3 encoder, whose second-to-last hidden
  states are the caption (`ZImagePipeline.encode_prompt`);
- the network's timestep is `(1000 - t) / 1000` of the scheduler's t = 1000 sigma, and its output
  is the negative velocity (the pipeline negates it);
- classifier-free guidance is written as the pipeline writes it, v_c + g (v_c - v_u) against the
  empty prompt, where the pipeline's `guidance_scale` g is `sampling.guidance_scale` - 1 (the
  recipe's scale is the usual v_u + s (v_c - v_u), so s = 1 runs no guidance, as g = 0 does);
- decode is the VAE of `latents / scaling_factor + shift_factor`.

The sigma schedule is the recipe's: `ZImagePipeline` samples `linspace(1, 1/T, T)` through its
scheduler's shift (`sampling.sigma_grid: steps`, `sampling.shift` its scheduler's, 3.0 for the
tiny model). The pipeline's `cfg_normalization` (a row's guided output rescaled to at most that
multiple of its cond output's norm) and `cfg_truncation` (no guidance on the steps whose
`(1000 - t) / 1000` exceeds it) are the model config's (`ZImageModelConfig`), off by default as in
the pipeline.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

from unirl.models.flow.guidance import ClassifierFreeGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_autoencoder_kl,
    tiny_qwen_tokenizer,
    vae_pixels,
)
from unirl.models.flow.packing import Packed2x2Bundle
from unirl.models.zimage.config import TinyZImageConfig

CHAT_WORDS = "user\nassistant\n"
"""The words of the chat template around a prompt: whole tokens of the tiny tokenizer."""


class ZImageBundle(Packed2x2Bundle, ClassifierFreeGuidance):
    """The modules of one Z-Image model plus the `ZImagePipeline` that owns them.

    Attributes:
        pipeline: a `ZImagePipeline`; its `encode_prompt` is the prompt encoder of record.
        transformer: the `ZImageTransformer2DModel` (the trainable module).
        vae: the `AutoencoderKL`.
        latent_channels, vae_scale_factor: the latent grid.
        sample_size: the image side in pixels (a tiny model's resolution; 1024 for a directory).
        cond_keys: `encode_text`'s keys. guidance: "cfg" (written as the pipeline does:
            `combine_guidance`).
    """

    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    LORA_PIPELINE: ClassVar[type] = ZImagePipeline  # reads write_weights' LoRA
    cfg_normalization: float = 0.0  # the pipeline's; 0: off (set by the config)
    cfg_truncation: float | None = None  # the pipeline's; None: off (set by the config)

    def __init__(self, pipeline: ZImagePipeline, sample_size: int) -> None:
        self.pipeline = pipeline
        self.transformer: ZImageTransformer2DModel = pipeline.transformer
        self.vae = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.sample_size = sample_size
        self.freeze_frozen_modules()

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`ZImagePipeline.encode_prompt`: each prompt's caption (its real tokens' second-to-last
        hidden states, [L_i, D]) zero-padded to prompt_embeds [U, L, D] (L = max_sequence_length)
        with prompt_embeds_mask [U, L] (1 on real tokens); with `guided` the empty prompt's
        under `negative_` keys (the pipeline's default negative prompt, encoded once per prompt
        as it does)."""
        captions, negatives = self.pipeline.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            do_classifier_free_guidance=guided,
            max_sequence_length=max_sequence_length,
        )
        out = dict(zip(self.cond_keys, padded(captions, max_sequence_length), strict=True))
        if guided:
            negative = padded(negatives, max_sequence_length)
            out.update(zip(("negative_" + k for k in self.cond_keys), negative, strict=True))
        return out

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B]: the network on the list
        of one [C, 1, h, w] latent and its real caption tokens per row at timestep
        `(1000 - 1000 sigma) / 1000`, negated (the pipeline's arithmetic)."""
        dtype = next(module.parameters()).dtype
        captions = [
            pe[m.bool()].to(dtype)
            for pe, m in zip(cond["prompt_embeds"], cond["prompt_embeds_mask"], strict=True)
        ]
        t = (1000 - sigma * 1000.0) / 1000
        out = module(list(x.to(dtype).unsqueeze(2).unbind(0)), t.to(dtype), captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def combine_guidance(
        self, v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """v_c + (s - 1) (v_c - v_u): `ZImagePipeline`'s pos + g (pos - neg) with g = s - 1, on
        the velocities (the pipeline negates after combining; negation is exact). With
        `cfg_normalization` c > 0 a row whose guided norm exceeds c x its cond norm is scaled
        down to it, row by row as the pipeline does (norms do not see the negation)."""
        guided = v_cond + (scale - 1.0) * (v_cond - v_uncond)
        if not self.cfg_normalization:
            return guided
        rows = []
        for pred, pos in zip(guided.unbind(0), v_cond.unbind(0), strict=True):
            largest = torch.linalg.vector_norm(pos) * float(self.cfg_normalization)
            norm = torch.linalg.vector_norm(pred)
            rows.append(pred * (largest / norm) if norm > largest else pred)
        return torch.stack(rows)

    def truncated(self, sigma: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows whose `(1000 - t) / 1000` (t = 1000 sigma, the pipeline's
        `_precomputed_t_norms`) exceeds `cfg_truncation`, where the pipeline guides with g = 0."""
        t_norm = (1000 - (sigma * 1000.0).float()) / 1000
        return t_norm.double() > float(self.cfg_truncation)

    def row_scales(self, sigma: torch.Tensor, scale: float) -> float | torch.Tensor:
        """`scale`, or with `cfg_truncation` 1 (g = 0) on the truncated rows ([B, 1, 1, 1])."""
        if self.cfg_truncation is None:
            return scale
        return torch.where(self.truncated(sigma), 1.0, scale).to(torch.float32).view(-1, 1, 1, 1)

    def guided_velocity(self, forward, x, sigma, cond, scale, uncond) -> torch.Tensor:
        """Classifier-free guidance (`ClassifierFreeGuidance`), except that a call whose rows are
        all truncated (`cfg_truncation`: a sampling step past it) runs the cond branch alone, as
        the pipeline does; rows of several steps batched together (replay) guide the truncated
        ones with g = 0 in the same forward."""
        if self.cfg_truncation is not None and scale > 1.0 and bool(self.truncated(sigma).all()):
            return forward(x, sigma, self.branch(cond))
        return super().guided_velocity(forward, x, sigma, cond, scale, uncond)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the VAE decode of
        `latents / scaling_factor + shift_factor`."""
        return vae_pixels(self.vae, latents)

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> ZImageBundle:
        """Load a local diffusers Z-Image directory."""
        pipe = ZImagePipeline.from_pretrained(path, torch_dtype=dtype, **pretrained_pipeline_options(path))
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.transformer.to(torch.float32)
        return cls(pipe, sample_size=1024)

    @classmethod
    def tiny(cls, cfg: TinyZImageConfig) -> ZImageBundle:
        """A randomly initialized tiny Z-Image, deterministic in `cfg.seed`."""
        from transformers import Qwen3Config, Qwen3Model

        from unirl.models.causal_lm.tiny import CHAT_TEMPLATE, EOS_TOKEN

        torch.manual_seed(cfg.seed)
        tokenizer = tiny_qwen_tokenizer(cfg.words, CHAT_WORDS)
        tokenizer.chat_template = CHAT_TEMPLATE  # Qwen's ChatML; `enable_thinking` changes nothing in it
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=cfg.text_hidden_size,
                intermediate_size=2 * cfg.text_hidden_size,
                num_hidden_layers=cfg.text_layers,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=cfg.text_hidden_size // 2,
                pad_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
            )
        ).eval()
        # FLUX.1's VAE class and factors (Z-Image uses FLUX.1's VAE)
        vae = tiny_autoencoder_kl(
            cfg.vae_downsample, cfg.latent_channels, scaling_factor=0.3611, shift_factor=0.1159
        )
        pipe = ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=tiny_transformer(cfg),
        )
        return cls(pipe, sample_size=cfg.resolution)


def padded(captions: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[U, length, D] captions zero-padded from their [L_i, D] real tokens, and the [U, length]
    mask (1 on real tokens)."""
    embeds = captions[0].new_zeros(len(captions), length, captions[0].shape[-1])
    mask = torch.zeros(len(captions), length, dtype=torch.long, device=embeds.device)
    for i, c in enumerate(captions):
        embeds[i, : len(c)] = c
        mask[i, : len(c)] = 1
    return embeds, mask


def tiny_transformer(cfg: TinyZImageConfig) -> ZImageTransformer2DModel:
    """The denoiser alone: `latent_channels` in and out, 2x2 patches."""
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=cfg.latent_channels,
        dim=cfg.dim,
        n_layers=cfg.num_layers,
        n_refiner_layers=cfg.num_refiner_layers,
        n_heads=cfg.num_heads,
        n_kv_heads=cfg.num_heads,
        cap_feat_dim=cfg.text_hidden_size,
        axes_dims=list(cfg.axes_dims_rope),
        # rotary positions: captions count along the first axis (up to 1024 tokens), the image's
        # patches along rows and columns (up to 128 each: 256 px at the tiny VAE's 2x)
        axes_lens=[1024, 128, 128],
    )


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> ZImageBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` with the
    LoRA loaded by `ZImagePipeline.load_lora_weights`, or the full `transformer/` directory."""
    return load_diffusers_checkpoint(
        path, lambda base: ZImageBundle.from_pretrained(base, dtype=dtype), ZImageTransformer2DModel
    )
