"""The FLUX.2 family: diffusers' `Flux2Transformer2DModel` over `AutoencoderKLFlux2` latents, as a
`FlowFamily` (`unirl.models.flow.family`) the shared `FlowMatchingStage` samples and replays, in
two prompt encoders and guidance styles:

- FLUX.2-dev (`Flux2Bundle`, `Flux2Pipeline`): a Mistral 3 prompt encoder (its hidden states 10,
  20 and 30 stacked per token, after a system message), guidance embedded in the network (the
  scale is an input, default 4.0), no uncond branch;
- FLUX.2-Klein (`Flux2KleinBundle`, `Flux2KleinPipeline`): a Qwen3 prompt encoder (hidden states
  9, 18, 27, through its chat template), no guidance embedding, classifier-free guidance
  v_u + s (v_c - v_u) against the empty prompt, in the pipeline's two forwards (`TrueCFGGuidance`).

What differs from FLUX.1, all inside this file:
- the stage's latents are the VAE's [B, C, h, w], normalised: the pipelines draw and denoise the
  2x2-patchified latents [B, 4C, h/2, w/2] normalised per channel by the VAE's batch-norm
  statistics, then flattened to tokens [B, h/2 * w/2, 4C]; that flattening is FLUX.1's 2x2 pack
  of [B, C, h, w] (`pack`: channel c of cell (dy, dx) is 4c + 2dy + dx in both), so the stage's
  latents are the pipeline's, unpatchified, and every algorithm sees [B, C, h, w] as for FLUX.1;
- positions are 4-axis (reference index, row, column, text position): image tokens (0, r, c, 0),
  text tokens (0, 0, 0, l);
- decode undoes the batch-norm normalisation on the patchified latents, then the VAE decodes
  (no scaling or shift factor);
- the schedule is `linspace(1, 1/T, T)` under FLUX.2's empirical mu (`sampling.sigma_grid:
  steps`, `dynamic_shift: true`, `mu_rule: empirical`: `unirl.sde.schedules.empirical_mu`).

Reference images (FLUX.2's multi-reference editing, the pipelines' `image`) are `references.py`.
Not built: caption upsampling (`caption_upsample_temperature`), Klein's KV-cached variant.
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from unirl.models.flow.guidance import EmbeddedGuidance, TrueCFGGuidance
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_qwen_tokenizer,
)
from unirl.models.flow.packing import Packed2x2Bundle, pack, unpack
from unirl.models.flux2.config import TEXT_LAYERS, TinyFlux2Config

MISTRAL_MARKERS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]")
MISTRAL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string else message['content'][0]['text'] %}"
    "{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{ '[INST]' + text + '[/INST]' }}{%- endif %}"
    "{%- endfor %}"
)
"""The tiny FLUX.2-dev tokenizer's chat template: Mistral's system and instruction markers around
the texts of `Flux2Pipeline`'s messages (a real directory's template is its own)."""


def positions(rows: int, cols: int, length: int = 1) -> torch.Tensor:
    """[rows * cols * length, 4] int64 4-axis position ids (0, r, c, l), row-major: the image
    tokens' (0, r, c, 0) for `length` 1, the text tokens' (0, 0, 0, l) for rows = cols = 1
    (`Flux2Pipeline._prepare_latent_ids` / `_prepare_text_ids`)."""
    one = torch.arange(1)
    return torch.cartesian_prod(one, torch.arange(rows), torch.arange(cols), torch.arange(length))


class Flux2BundleBase(Packed2x2Bundle):
    """What FLUX.2-dev and Klein share: the modules of one model plus the pipeline that owns them,
    the network call, the decode and the loading; the subclass brings the prompt encoder
    (`ENCODER`, `PIPELINE` and `LORA_PIPELINE`, `tiny_text(cfg)` -> (tokenizer, encoder)) and the
    guidance style.

    Attributes:
        pipeline: the `PIPELINE`; its `encode_prompt` is the prompt encoder of record.
        transformer: the `Flux2Transformer2DModel` (the trainable module).
        vae: the `AutoencoderKLFlux2`.
        latent_channels, vae_scale_factor: the latent grid (C = transformer in_channels / 4).
        sample_size: the image side in pixels (a tiny model's resolution; 1024 for a directory).
        text_layers: the prompt encoder's hidden states stacked into the caption (the pipeline's).
    """

    cond_keys = ("prompt_embeds",)
    PIPELINE: ClassVar[type]
    ENCODER: ClassVar[str]

    def __init__(self, pipeline, sample_size: int) -> None:
        self.pipeline = pipeline
        self.transformer: Flux2Transformer2DModel = pipeline.transformer
        self.vae: AutoencoderKLFlux2 = pipeline.vae
        self.latent_channels = self.transformer.config.in_channels // 4
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.sample_size = sample_size
        self.text_layers = TEXT_LAYERS[self.ENCODER]
        self.freeze_frozen_modules()

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """The pipeline's `encode_prompt`: prompt_embeds [U, L, 3D] (L = max_sequence_length, the
        three hidden states of `text_layers` side by side per token); with `guided` the empty
        prompt's under `negative_prompt_embeds` (Klein's negative, encoded once per prompt as its
        pipeline does)."""
        out = {"prompt_embeds": self._encode(list(prompts), max_sequence_length)}
        if guided:
            out["negative_prompt_embeds"] = self._encode([""] * len(prompts), max_sequence_length)
        return out

    def _encode(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=max_sequence_length,
            text_encoder_out_layers=self.text_layers,
        )  # fmt: skip
        return embeds

    def predict(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: dict,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B]: the network on the
        packed tokens with 4-axis positions, at timestep `(sigma * 1000) / 1000`, with `guidance`
        [B] for a transformer that embeds it (required then; one without takes only 1.0, i.e.
        none). With reference images (`cond["reference_tokens"]` [B, R, 4C] and their ids
        [B, R, 4], `references.py`) their tokens follow the sample's, and the velocity is read
        from the sample's."""
        guidance = EmbeddedGuidance.network_guidance(
            guidance, bool(self.transformer.config.guidance_embeds), "FLUX.2"
        )
        dtype = next(module.parameters()).dtype
        _, _, h, w = x.shape
        text = cond["prompt_embeds"]
        tokens, ids = pack(x), positions(h // 2, w // 2).to(x.device)
        sample_tokens = tokens.shape[1]
        if "reference_tokens" in cond:
            tokens = torch.cat([tokens, cond["reference_tokens"].to(tokens.dtype)], dim=1)
            ids = torch.cat([ids, cond["reference_ids"][0].to(ids)])
        out = module(
            hidden_states=tokens.to(dtype),
            encoder_hidden_states=text.to(dtype),
            timestep=(sigma * 1000.0 / 1000).to(dtype),
            img_ids=ids,
            txt_ids=positions(1, 1, text.shape[1]).to(x.device),
            guidance=None if guidance is None else guidance.to(dtype),
            return_dict=False,
        )[0]
        return unpack(out[:, :sample_tokens].contiguous(), h, w)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the latents
        patchified 2x2, un-normalised by the VAE's batch-norm statistics, unpatchified and decoded
        (the pipelines' arithmetic, through their own patchify helpers)."""
        vae = self.vae
        z = self.PIPELINE._patchify_latents(latents.to(vae.dtype))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            z.device, z.dtype
        )
        z = self.PIPELINE._unpatchify_latents(z * std + mean)
        return vae.decode(z, return_dict=False)[0].float()

    def model_info(self) -> dict:
        """`patch_size` 2: a token is a 2x2 patch of latent cells."""
        return {"pixel_space": False, "vae_scale_factor": self.vae_scale_factor, "patch_size": 2}

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32):
        """Load a local diffusers directory of this pipeline."""
        options = {**pretrained_pipeline_options(path), **cls.pretrained_components(path)}
        if "vae" in options:  # options says vae=None for a directory without vae/
            raise FileNotFoundError(
                f"model.pretrained_path {path!r} has no vae/: FLUX.2 decodes with its VAE"
            )
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype, **options)
        check_scheduler_config(dict(pipe.scheduler.config), os.path.join(path, "scheduler"))
        pipe.transformer.to(torch.float32)
        return cls(pipe, sample_size=pipe.default_sample_size * pipe.vae_scale_factor)

    @classmethod
    def pretrained_components(cls, path: str) -> dict:
        """Components the pipeline's `from_pretrained` is given instead of reading (none)."""
        return {}

    @classmethod
    def tiny(cls, cfg: TinyFlux2Config):
        """A randomly initialized tiny model, deterministic in `cfg.seed`."""
        torch.manual_seed(cfg.seed)
        tokenizer, text_encoder = cls.tiny_text(cfg)
        pipe = cls.PIPELINE(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
            vae=tiny_vae(cfg),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=tiny_transformer(cfg),
        )
        return cls(pipe, sample_size=cfg.resolution)


class Flux2Bundle(Flux2BundleBase, EmbeddedGuidance):
    """A FLUX.2-dev model (`Flux2Pipeline`): Mistral 3 prompts, guidance embedded."""

    PIPELINE: ClassVar[type] = Flux2Pipeline
    LORA_PIPELINE: ClassVar[type] = Flux2Pipeline
    ENCODER: ClassVar[str] = "mistral3"

    @classmethod
    def pretrained_components(cls, path: str) -> dict:
        """The prompt's tokenizer alone: a FLUX.2-dev `tokenizer/` is a `PixtralProcessor`, which
        transformers builds only with torchvision (left out of this install); the prompt encoder
        reads text only, through the processor's tokenizer and chat template."""
        return {"tokenizer": text_tokenizer(os.path.join(path, "tokenizer"))}

    @staticmethod
    def tiny_text(cfg: TinyFlux2Config) -> tuple:
        """A tiny Mistral 3 (`Mistral3ForConditionalGeneration`: a 1-layer Pixtral vision tower the
        prompt never reaches, a `text_layers`-deep Mistral) over a tokenizer whose words are the
        system message's and `cfg.words`, with Mistral's markers and `MISTRAL_TEMPLATE`."""
        from transformers import (
            Mistral3Config,
            Mistral3ForConditionalGeneration,
            MistralConfig,
            PixtralVisionConfig,
        )

        tokenizer = tiny_qwen_tokenizer(cfg.words, SYSTEM_MESSAGE)
        tokenizer.add_tokens(list(MISTRAL_MARKERS) + ["[IMG]"], special_tokens=True)
        tokenizer.chat_template = MISTRAL_TEMPLATE
        width = cfg.text_hidden_size
        text = MistralConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1,
            head_dim=width // 2, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        vision = PixtralVisionConfig(
            hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=2,
            head_dim=width // 2, image_size=32, patch_size=16,
        )  # fmt: skip
        config = Mistral3Config(
            vision_config=vision, text_config=text, spatial_merge_size=1,
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        )  # fmt: skip
        return tokenizer, Mistral3ForConditionalGeneration(config).eval()


class Flux2KleinBundle(Flux2BundleBase, TrueCFGGuidance):
    """A FLUX.2-Klein model (`Flux2KleinPipeline`): Qwen3 prompts, classifier-free guidance
    v_u + s (v_c - v_u) against the empty prompt (the pipeline's neg + s (pos - neg)), the cond and
    uncond branches in forwards of their own, cond first, as the pipeline runs them (one batch of
    both halves is the same arithmetic, but other GEMM shapes: not bit-equal on every CPU)."""

    PIPELINE: ClassVar[type] = Flux2KleinPipeline
    LORA_PIPELINE: ClassVar[type] = Flux2KleinPipeline
    ENCODER: ClassVar[str] = "qwen3"

    @staticmethod
    def tiny_text(cfg: TinyFlux2Config) -> tuple:
        """A tiny `Qwen3ForCausalLM`, `text_layers` deep, over a tokenizer with Qwen's ChatML
        template whose words are the template's and `cfg.words`."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from unirl.models.causal_lm.tiny import CHAT_TEMPLATE, EOS_TOKEN

        tokenizer = tiny_qwen_tokenizer(cfg.words, "user\nassistant\n")
        tokenizer.chat_template = CHAT_TEMPLATE  # Qwen's ChatML; `enable_thinking` changes nothing in it
        width = cfg.text_hidden_size
        config = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1,
            head_dim=width // 2, pad_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        )  # fmt: skip
        return tokenizer, Qwen3ForCausalLM(config).eval()


def text_tokenizer(path: str):
    """The tokenizer of a FLUX.2-dev `tokenizer/` directory with its chat template (the
    tokenizer's own, else the processor's `chat_template.json`); FileNotFoundError naming the
    directory when it has no template (the prompt encoder formats every prompt through it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor_template = os.path.join(path, "chat_template.json")
    if tokenizer.chat_template is None and os.path.isfile(processor_template):
        with open(processor_template) as f:
            tokenizer.chat_template = json.load(f)["chat_template"]
    if tokenizer.chat_template is None:
        raise FileNotFoundError(
            f"{path} has no chat template (chat_template.jinja or chat_template.json): Flux2Pipeline "
            "formats every prompt through its tokenizer's chat template"
        )
    return tokenizer


def tiny_vae(cfg: TinyFlux2Config) -> AutoencoderKLFlux2:
    """A tiny random `AutoencoderKLFlux2` (`vae_downsample`x into `latent_channels`), its
    batch-norm statistics over the 4 x `latent_channels` patchified channels set to a fixed spread
    (means linspace(-0.5, 0.5), variances linspace(0.5, 2.0)) so the normalisation is not the
    identity."""
    levels = cfg.vae_downsample.bit_length()
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(16,) + (32,) * (levels - 1),
        latent_channels=cfg.latent_channels,
        norm_num_groups=8,
        layers_per_block=1,
    )
    channels = 4 * cfg.latent_channels
    vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    return vae


def tiny_transformer(cfg: TinyFlux2Config) -> Flux2Transformer2DModel:
    """The denoiser alone: 4 x `latent_channels` in and out per token, a caption 3 x
    `text_hidden_size` wide (three stacked hidden states)."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * cfg.latent_channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=3 * cfg.text_hidden_size,
        timestep_guidance_channels=32,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
        guidance_embeds=cfg.guidance_embeds,
    )


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, bundle_class: type = Flux2Bundle):
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` (from
    `unirl_checkpoint.json`) with the LoRA loaded by the pipeline's `load_lora_weights`, or the
    full `transformer/` directory (`unirl.models.flow.loading.load_diffusers_checkpoint`)."""
    return load_diffusers_checkpoint(
        path, lambda base: bundle_class.from_pretrained(base, dtype=dtype), Flux2Transformer2DModel
    )
