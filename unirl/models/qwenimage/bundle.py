"""The Qwen-Image family: diffusers' `QwenImageTransformer2DModel` with a Qwen2.5-VL prompt encoder
and the `AutoencoderKLQwenImage`, as a `FlowFamily` (`unirl.models.flow.family`) the shared
`FlowMatchingStage` samples and replays.

What differs from SD3 and FLUX, all inside this file:
- latents [B, C, h, w] (h, w even) are packed 2x2 into tokens [B, h/2 * w/2, 4C] for the network
  and unpacked after, with `img_shapes` (1, h/2, w/2) for the rotary embedding, as
  `QwenImagePipeline` does; the stage's latents stay [B, C, h, w];
- prompts go through QwenImagePipeline's chat template into Qwen2.5-VL, whose last hidden states
  after the template's 34 system tokens are the conditioning, padded here to
  `max_sequence_length` with `prompt_embeds_mask` marking the real tokens (the transformer masks
  the rest out of attention; a mask of all ones is passed as None, as the pipeline does);
- guidance is "true_cfg": the negative prompt's branch and the cond branch run in forwards of
  their own and combine as v_u + s (v_c - v_u), rescaled per packed token to the norm of v_c
  (`combine_guidance`: QwenImagePipeline's `true_cfg_scale` arithmetic);
- the transformer's timestep is `(sigma * 1000) / 1000` (the pipeline's arithmetic);
- decode is the VAE of `latents / (1 / latents_std) + latents_mean` per channel on one frame.

The sigma schedule is the recipe's (`sampling.sigma_grid: steps`, `sampling.dynamic_shift: true`
is what `QwenImagePipeline` samples with; mu from the packed token count).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

from unirl.models.flow.guidance import TrueCFGGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    latents_mean_std_decode,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_causal_vae,
    tiny_qwen_tokenizer,
)
from unirl.models.flow.packing import Packed2x2Bundle, pack, unpack
from unirl.models.qwenimage.config import TinyQwenImageConfig

TEMPLATE_WORDS = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:\nuser\nassistant\n"
)
"""The words of QwenImagePipeline's prompt template (without its special tokens): whole tokens of
the tiny tokenizer, so the template's prefix is 34 tokens as with Qwen2.5-VL's tokenizer."""


class QwenImageBundle(Packed2x2Bundle, TrueCFGGuidance):
    """The modules of one Qwen-Image model plus the `QwenImagePipeline` that owns them.

    Attributes:
        pipeline: a `QwenImagePipeline` (vae None in pixel space); its `encode_prompt` is the
            prompt encoder of record.
        transformer: the `QwenImageTransformer2DModel` (the trainable module).
        vae: `AutoencoderKLQwenImage` or None (pixel space).
        latent_channels, vae_scale_factor: the latent grid (C = transformer in_channels / 4).
        sample_size: the image side in pixels (a tiny model's resolution; QwenImagePipeline's
            default 1024 for a directory).
        negative_prompt: true CFG's uncond prompt (None: the family cannot run guided).
        cond_keys: `encode_text`'s keys. guidance: "true_cfg".
    """

    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    LORA_PIPELINE: ClassVar[type] = QwenImagePipeline  # reads write_weights' LoRA
    PIPELINE: ClassVar[type] = QwenImagePipeline  # the diffusers pipeline class this bundle owns
    TEMPLATE: ClassVar[str] = TEMPLATE_WORDS  # the words of its prompt template (the tiny tokenizer's)

    def __init__(
        self, pipeline: QwenImagePipeline, sample_size: int, negative_prompt: str | None = " "
    ) -> None:
        self.pipeline = pipeline
        self.transformer: QwenImageTransformer2DModel = pipeline.transformer
        self.vae: AutoencoderKLQwenImage | None = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels // 4
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample) if self.vae is not None else 1
        self.sample_size = sample_size
        self.negative_prompt = negative_prompt
        self.freeze_frozen_modules()

    # ---- network ----------------------------------------------------------------------------
    def _encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`QwenImagePipeline.encode_prompt` ([U, L', D], L' the longest prompt's tokens, at most
        `max_sequence_length`) padded with zeros to [U, max_sequence_length, D], and its mask
        [U, max_sequence_length] (1 on real tokens)."""
        pe, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=max_sequence_length
        )
        u, length, _ = pe.shape
        if mask is None:
            mask = torch.ones(u, length, dtype=torch.long, device=pe.device)
        pad = max_sequence_length - length
        return (
            torch.nn.functional.pad(pe, (0, 0, 0, pad)),
            torch.nn.functional.pad(mask.to(torch.long), (0, pad)),
        )

    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """prompt_embeds [U, L, D] (Qwen2.5-VL's last hidden states after the template prefix,
        zero-padded to L = max_sequence_length) and prompt_embeds_mask [U, L]; with `guided`
        also the `negative_prompt`'s under `negative_` keys (repeated to U rows)."""
        pe, mask = self._encode(prompts, max_sequence_length)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if guided:
            if self.negative_prompt is None:
                raise ValueError(
                    "Qwen-Image's true CFG needs a negative prompt: set model.negative_prompt or "
                    "sampling.guidance_scale: 1.0"
                )
            npe, nmask = self._encode([self.negative_prompt], max_sequence_length)
            out["negative_prompt_embeds"] = npe.expand(len(prompts), -1, -1)
            out["negative_prompt_embeds_mask"] = nmask.expand(len(prompts), -1)
        return out

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B]: the image stream of
        `image_tokens` with its `img_shapes`, the timestep `(sigma * 1000) / 1000` and the text
        mask (None when every position is a real token, as QwenImagePipeline passes it); the
        velocity is read from the sample's own h/2 * w/2 tokens."""
        dtype = next(module.parameters()).dtype
        b, _, h, w = x.shape
        mask = cond["prompt_embeds_mask"]
        tokens, shapes = self.image_tokens(x, cond)
        out = module(
            hidden_states=tokens.to(dtype),
            timestep=(sigma * 1000.0 / 1000).to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=None if bool(mask.bool().all()) else mask.to(torch.long),
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return unpack(out[:, : (h // 2) * (w // 2)], h, w)

    def image_tokens(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The image stream the transformer sees: the latents packed 2x2 [B, h/2 * w/2, 4C] and
        the (frames, rows, columns) of each image in it, here the sample's (1, h/2, w/2) alone (an
        edit family appends its references' tokens and shapes after them)."""
        _, _, h, w = x.shape
        return pack(x), [(1, h // 2, w // 2)]

    @staticmethod
    def combine_guidance(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image's true CFG on [B, C, h, w] velocities: comb = v_u + s (v_c - v_u), then
        comb * |v_c| / |comb| with the norms over each packed token's 4C values (QwenImagePipeline
        takes them over the last dim of the packed [B, tokens, 4C] predictions)."""
        _, _, h, w = v_cond.shape
        cond, comb = pack(v_cond), pack(v_uncond + scale * (v_cond - v_uncond))
        return unpack(comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)), h, w)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the VAE decode of
        `latents / (1 / latents_std) + latents_mean` on one frame (QwenImagePipeline's arithmetic),
        or the latents themselves in pixel space."""
        if self.vae is None:
            return latents.float()
        return latents_mean_std_decode(self.vae, latents.unsqueeze(2))[:, :, 0].float()

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype = torch.float32, negative_prompt: str | None = " ", **options
    ) -> QwenImageBundle:
        """Load a local diffusers directory of `PIPELINE`; a missing vae/ means pixel space.
        `options` go to the bundle's constructor (an edit family's condition settings)."""
        extra = {**pretrained_pipeline_options(path), **cls.pretrained_modules(path)}
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype, **extra)
        # the terminal stretch is the recipe's `sampling.shift_terminal` (Qwen-Image's 0.02), like the shift
        check_scheduler_config(
            dict(pipe.scheduler.config), os.path.join(path, "scheduler"), ("shift_terminal",)
        )
        pipe.transformer.to(torch.float32)
        scale = 2 ** len(pipe.vae.temperal_downsample) if pipe.vae is not None else 1
        sample_size = pipe.default_sample_size * (scale if pipe.vae is not None else 8)
        return cls(pipe, sample_size=sample_size, negative_prompt=negative_prompt, **options)

    @classmethod
    def pretrained_modules(cls, path: str) -> dict:
        """Modules of a directory this bundle loads itself rather than through `PIPELINE` ({})."""
        return {}

    @classmethod
    def tiny(cls, cfg: TinyQwenImageConfig, negative_prompt: str | None = " ", **options) -> QwenImageBundle:
        """A randomly initialized tiny model of `PIPELINE`, deterministic in `cfg.seed`."""
        pipe = cls.PIPELINE(**cls.tiny_modules(cfg))
        return cls(pipe, sample_size=cfg.resolution, negative_prompt=negative_prompt, **options)

    @classmethod
    def tiny_modules(cls, cfg: TinyQwenImageConfig) -> dict:
        """The tiny pipeline's modules: scheduler, vae (None in pixel space), text_encoder,
        tokenizer (over `TEMPLATE`'s words and `cfg.words`), transformer."""
        torch.manual_seed(cfg.seed)
        tokenizer = tiny_qwen_tokenizer(cfg.words, cls.TEMPLATE)
        vae = None
        if not cfg.pixel_space:
            levels = cfg.vae_downsample.bit_length() - 1  # spatial downsamples
            vae = tiny_causal_vae(
                AutoencoderKLQwenImage,
                cfg.vae_base_dim,
                cfg.latent_channels,
                levels,
                num_res_blocks=1,
                temperal_downsample=[False] * levels,  # one frame: no temporal compression
            )
        return dict(
            # Qwen-Image's scheduler: exponential time shift, dynamic mu in [0.5, 0.9] over 256..8192 tokens
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=1.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=0.9,
                base_image_seq_len=256,
                max_image_seq_len=8192,
            ),  # fmt: skip
            vae=vae,
            text_encoder=tiny_text_encoder(cfg, tokenizer),
            tokenizer=tokenizer,
            transformer=tiny_transformer(cfg),
        )


def tiny_text_encoder(cfg: TinyQwenImageConfig, tokenizer):
    """A tiny random `Qwen2_5_VLForConditionalGeneration` over `tokenizer` (the causal-LM package's
    tiny VLM builder: 2 heads, a 1-layer vision tower the pipeline never calls)."""
    from unirl.models.causal_lm.tiny import EOS_TOKEN, VISION_TOKENS, TinyVLMConfig, tiny_vlm_model

    vlm = TinyVLMConfig(
        architecture="qwen2_5_vl",
        hidden_size=cfg.text_hidden_size,
        num_layers=cfg.text_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * cfg.text_hidden_size,
        vision_depth=1,
        vision_hidden_size=16,
        vision_intermediate_size=32,
        seed=cfg.seed,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    ids["eos"] = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return tiny_vlm_model(vlm, len(tokenizer), ids).eval()


def tiny_transformer(cfg: TinyQwenImageConfig) -> QwenImageTransformer2DModel:
    """The denoiser alone: 4 x (3 pixel channels, or `latent_channels`) in and out per token."""
    channels = 3 if cfg.pixel_space else cfg.latent_channels
    return QwenImageTransformer2DModel(
        patch_size=1,
        in_channels=4 * channels,
        out_channels=4 * channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_hidden_size,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
        zero_cond_t=cfg.zero_cond_t,
    )


def load_checkpoint(
    path: str,
    dtype: torch.dtype = torch.float32,
    negative_prompt: str | None = " ",
    bundle_class: type = QwenImageBundle,
    **options,
) -> QwenImageBundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` (from
    `unirl_checkpoint.json`) with the LoRA loaded by the pipeline's `load_lora_weights`, or the
    full `transformer/` directory (`unirl.models.flow.loading.load_diffusers_checkpoint`);
    `options` go to `bundle_class` (an edit family's condition settings)."""
    return load_diffusers_checkpoint(
        path,
        lambda base: bundle_class.from_pretrained(
            base, dtype=dtype, negative_prompt=negative_prompt, **options
        ),
        QwenImageTransformer2DModel,
    )
