"""The HunyuanVideo 1.5 text-to-video family: diffusers' `HunyuanVideo15Transformer3DModel` with a
Qwen2.5-VL prompt encoder, a ByT5 glyph encoder and the causal video VAE
`AutoencoderKLHunyuanVideo15`, as a `FlowFamily` (`unirl.models.flow.family`) the shared
`FlowMatchingStage` samples and replays.

What differs from Wan, all inside this file:
- two prompt encodings, through the pipeline's own encoders: the Qwen2.5-VL text model's
  third-to-last hidden states under a system message, the template's first 108 tokens cropped,
  with their mask (`prompt_embeds`, `prompt_embeds_mask`; `sampling.max_sequence_length` is the
  pipeline's `tokenizer_max_length`), and ByT5's encoding of the prompt's quoted text
  ("Text "...". "), zeros with a zero mask when it quotes none (`prompt_embeds_2`,
  `prompt_embeds_mask_2`, 256 tokens); the uncond branch encodes the empty prompt the same way;
- the network's input is the latents with a zero condition latent and a zero mask beside them
  (2C + 1 channels: the text-to-video case of the model shared with image-to-video), an all-zero
  image stream (729 tokens), and the timestep `sigma * 1000`;
- one token per latent cell (patch 1);
- decode is the VAE of `latents / scaling_factor`, one sample at a time: diffusers 0.42's
  `AutoencoderKLHunyuanVideo15` builds its mid-block attention mask [B, L, L] against queries
  [B, 1, L, L], which broadcasts only for B = 1.

Guidance is classifier-free, v_u + s (v_c - v_u), against the empty prompt, with the cond and the
uncond branch in forwards of their own, cond first, as the pipeline's guider runs them
(`TrueCFGGuidance`; the pipeline's guider at `guidance_scale` s).
The schedule is `linspace(1, 1/T, T)` through the scheduler's static shift: `sampling.sigma_grid:
steps`, `sampling.shift` the directory scheduler's (the pipeline's `linspace(1, 0, T + 1)[:-1]` is
the same grid).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.loaders import HunyuanVideoLoraLoaderMixin

from unirl.models.flow.guidance import TrueCFGGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_qwen_tokenizer,
)
from unirl.models.flow.packing import VideoClipBundle
from unirl.models.hunyuanvideo.config import TinyHunyuanVideo15Config

CHAT_WORDS = "system\nuser\nassistant\n"
"""The chat template's words around the system message: whole tokens of the tiny tokenizer."""


class HunyuanVideo15Bundle(VideoClipBundle, TrueCFGGuidance):
    """The modules of one HunyuanVideo 1.5 T2V model plus the `HunyuanVideo15Pipeline` that owns
    them.

    Attributes:
        pipeline: a `HunyuanVideo15Pipeline`; its prompt encoders are the encoders of record.
        transformer: the `HunyuanVideo15Transformer3DModel` (the trainable module).
        vae: the `AutoencoderKLHunyuanVideo15`.
        num_frames: frames per video (the latent clip has (num_frames - 1) / temporal + 1).
        temporal, spatial: the VAE's compression along time and along each side.
        sample_size: the frame side in pixels (a tiny model's resolution; the transformer's
            `target_size` for a directory).
    """

    TEXT_KEYS: ClassVar[tuple[str, ...]] = (
        "prompt_embeds",
        "prompt_embeds_mask",
        "prompt_embeds_2",
        "prompt_embeds_mask_2",
    )
    cond_keys = TEXT_KEYS
    # writes the LoRA file (`write_weights`): HunyuanVideo15Pipeline has no LoRA loader in diffusers
    # 0.42; its transformer's `load_lora_adapter` reads the file (`load_checkpoint`)
    LORA_PIPELINE: ClassVar[type] = HunyuanVideoLoraLoaderMixin
    # the prompt encoders: the Qwen2.5-VL text model and ByT5, in the pipeline's order
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    PIPELINE: ClassVar[type] = HunyuanVideo15Pipeline

    def __init__(self, pipeline: HunyuanVideo15Pipeline, num_frames: int, sample_size: int) -> None:
        self.pipeline = pipeline
        self.transformer: HunyuanVideo15Transformer3DModel = pipeline.transformer
        self.vae: AutoencoderKLHunyuanVideo15 = pipeline.vae
        self.latent_channels = self.transformer.config.out_channels
        vae = self.vae.config
        temporal, spatial = int(vae.temporal_compression_ratio), int(vae.spatial_compression_ratio)
        self.set_clip(num_frames, sample_size, temporal, spatial, "this HunyuanVideo 1.5 VAE")

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """The pipeline's two encoders: prompt_embeds [U, L, D] and its mask [U, L] (L =
        max_sequence_length, the Qwen2.5-VL text after the cropped template), prompt_embeds_2
        [U, 256, D2] and its mask (ByT5 over the quoted text; zeros without any); with `guided`
        the empty prompt's under `negative_` keys (the pipeline's default negative prompt)."""
        return self.encode_text_keys(prompts, guided, max_sequence_length)

    def _encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, ...]:
        """`HunyuanVideo15Pipeline.encode_prompt`'s two encodings, the first at `length` tokens
        (the pipeline's own static encoders, with its system message, crop and glyph budget)."""
        pipe = self.pipeline
        embeds, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, prompt=prompts, device=self.device,
            tokenizer_max_length=length, system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx,
        )  # fmt: skip
        embeds_2, mask_2 = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2, prompt=prompts, device=self.device,
            tokenizer_max_length=pipe.tokenizer_2_max_length,
        )  # fmt: skip
        dtype = pipe.text_encoder.dtype
        return embeds.to(dtype), mask.to(dtype), embeds_2.to(dtype), mask_2.to(dtype)

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """Velocity [B, C, f, h, w] at video latents x [B, C, f, h, w] and sigma [B]: the network
        on x with a zero condition latent and zero mask beside it, the all-zero image stream and
        both prompt encodings, at timestep `sigma * 1000`."""
        dtype = next(module.parameters()).dtype
        x = x.to(dtype)
        condition, image = self.image_inputs(x, cond)
        return module(
            hidden_states=torch.cat([x, condition.to(dtype)], dim=1),
            image_embeds=image.to(dtype),
            timestep=(sigma * 1000.0).to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_embeds_mask"].to(dtype),
            encoder_hidden_states_2=cond["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"].to(dtype),
            return_dict=False,
        )[0]

    def image_inputs(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the condition latents and first-frame mask [B, C + 1, f, h, w] concatenated after x,
        the image stream [B, N, D]): all zeros in text-to-video (the pipeline's; `i2v.py` reads a
        first frame)."""
        b, _, f, h, w = x.shape
        pipe = self.pipeline
        condition = torch.cat([torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)
        return condition, x.new_zeros(b, pipe.vision_num_semantic_tokens, pipe.vision_states_dim)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, F, 3, H, W] fp32 RGB frames in about [-1, 1] (unclamped), differentiable: the VAE
        decode of `latents / scaling_factor`, one sample at a time (module doc), frames moved before
        channels."""
        vae = self.vae
        scaled = latents.to(vae.dtype) / vae.config.scaling_factor
        frames = [vae.decode(one, return_dict=False)[0] for one in scaled.split(1)]
        return torch.cat(frames).float().transpose(1, 2)

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str, num_frames: int, dtype: torch.dtype = torch.float32
    ) -> HunyuanVideo15Bundle:
        """Load a local diffusers HunyuanVideo 1.5 T2V directory."""
        if pretrained_pipeline_options(path):
            raise FileNotFoundError(
                f"model.pretrained_path {path!r} has no vae/: HunyuanVideo 1.5 decodes with its VAE"
            )
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype)
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.vae.to(torch.float32)
        pipe.transformer.to(torch.float32)
        return cls(pipe, num_frames, sample_size=int(pipe.transformer.config.target_size))

    @classmethod
    def tiny(cls, cfg: TinyHunyuanVideo15Config, num_frames: int) -> HunyuanVideo15Bundle:
        """A randomly initialized tiny model, deterministic in `cfg.seed`: the pipeline is built
        first without its prompt encoder, whose tokenizer is trained on the pipeline's own system
        message, then given it."""
        from diffusers.guiders import ClassifierFreeGuidance as Guider
        from transformers import (
            ByT5Tokenizer,
            Qwen2_5_VLTextConfig,
            Qwen2_5_VLTextModel,
            T5Config,
            T5EncoderModel,
        )

        from unirl.models.causal_lm.tiny import CHAT_TEMPLATE, EOS_TOKEN

        torch.manual_seed(cfg.seed)
        tokenizer_2 = ByT5Tokenizer()
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2), d_model=cfg.byt5_hidden_size, d_ff=2 * cfg.byt5_hidden_size,
                d_kv=cfg.byt5_hidden_size // 2, num_layers=1, num_heads=2,
            )
        ).eval()  # fmt: skip
        pipe = cls.PIPELINE(
            **cls.tiny_image_modules(cfg),
            text_encoder=None,
            tokenizer=None,
            transformer=tiny_transformer(cfg),
            vae=AutoencoderKLHunyuanVideo15(
                latent_channels=cfg.latent_channels,
                block_out_channels=tuple(cfg.vae_widths),
                layers_per_block=1,
                spatial_compression_ratio=cfg.vae_spatial,
                temporal_compression_ratio=cfg.vae_temporal,
            ),  # fmt: skip
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            guider=Guider(guidance_scale=6.0),
        )
        tokenizer = tiny_qwen_tokenizer(cfg.words, CHAT_WORDS + pipe.system_message, qwen_split=True)
        tokenizer.chat_template = CHAT_TEMPLATE  # Qwen's ChatML, the real template's layout
        width, eos = cfg.text_hidden_size, tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1,
                pad_token_id=eos, bos_token_id=eos, eos_token_id=eos,
                rope_parameters={
                    "rope_type": "default", "mrope_section": mrope_section(width // 2), "rope_theta": 10000.0
                },
            )
        ).eval()  # fmt: skip
        pipe.register_modules(text_encoder=text_encoder, tokenizer=tokenizer)
        return cls(pipe, num_frames, sample_size=cfg.resolution)

    @classmethod
    def tiny_image_modules(cls, cfg: TinyHunyuanVideo15Config) -> dict:
        """What the tiny pipeline takes besides the text-to-video modules (none; image-to-video's
        image encoder: `i2v.py`)."""
        return {}


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's multimodal rotary sections (temporal, height, width) over head_dim / 2
    frequencies, in its 1 : 1.5 : 1.5 split (16, 24, 24 of 64)."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_transformer(cfg: TinyHunyuanVideo15Config) -> HunyuanVideo15Transformer3DModel:
    """The denoiser alone: 2 x `latent_channels` + 1 in (latents, condition latents, mask),
    `latent_channels` out, patch 1."""
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * cfg.latent_channels + 1,
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers,
        num_refiner_layers=cfg.num_refiner_layers,
        text_embed_dim=cfg.text_hidden_size,
        text_embed_2_dim=cfg.byt5_hidden_size,
        image_embed_dim=cfg.image_embed_dim,
        rope_axes_dim=tuple(cfg.rope_axes_dim),
        target_size=cfg.resolution,
        task_type="t2v",
    )


def load_checkpoint(path: str, num_frames: int, dtype: torch.dtype = torch.float32) -> HunyuanVideo15Bundle:
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` with the
    LoRA loaded by `HunyuanVideo15Pipeline.load_lora_weights`, or the full `transformer/`
    directory."""
    return load_diffusers_checkpoint(
        path,
        lambda base: HunyuanVideo15Bundle.from_pretrained(base, num_frames, dtype=dtype),
        HunyuanVideo15Transformer3DModel,
    )
