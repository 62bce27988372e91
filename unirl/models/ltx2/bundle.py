"""The LTX-2 audio-video family: diffusers' `LTX2VideoTransformer3DModel` (a video stream and an
audio stream denoised together, each attending to the other) with a Gemma 3 prompt encoder and
LTX-2's text connectors, the video VAE `AutoencoderKLLTX2Video`, the audio VAE
`AutoencoderKLLTX2Audio` and the `LTX2Vocoder`, as a `FlowFamily` (`unirl.models.flow.family`)
the shared `FlowMatchingStage` samples and replays.

**One latent for both streams.** A sample's latent is [C, N_v + N_a]: the video latents
[C, f, h, w] as N_v = f x h x w tokens (patch 1, the pipeline's packing transposed), then the
audio latents [C_a, L, M] as N_a = L tokens of C_a x M channels (the pipeline's audio packing,
transposed), with C_a x M == C. Both streams share the sigma schedule (the pipeline runs a copy
of its scheduler for the audio), so the stage's Euler, SDE and log-prob arithmetic, elementwise,
is the pipeline's on both; a sample's log-probability is the joint one over video and audio.

What differs from the other video families, all inside this file:
- the prompt encoding is the pipeline's: Gemma 3's hidden states of every layer stacked
  (left-padded to `sampling.max_sequence_length` tokens), then the connectors, which give the
  video stream's and the audio stream's text tokens and their mask (`video_embeds`,
  `audio_embeds`, `text_mask`); the uncond branch encodes the empty prompt;
- the network call takes both streams at timestep `sigma * 1000` with the clip's geometry (latent
  frames, sides, `frame_rate`, audio latent frames) and returns both velocities;
- guidance is classifier-free in the pipeline's x0 form: each branch's x0 = x - sigma v, the
  guided x0 = x0_c + (s - 1)(x0_c - x0_u), back to a velocity (x - x0) / sigma, with the video's
  scale on the video tokens and `audio_guidance_scale` on the audio tokens, the uncond and cond
  halves in one forward; the pipeline's other guidance terms are the model config's options
  (`ExtraGuidance`: spatio-temporal guidance, modality-isolation guidance, each one more forward
  of the cond branch, and the guidance rescale), added to the guided x0 in the pipeline's order;
- decode: the video latents denormalized by the VAE's latents mean / std and decoded to frames;
  the audio latents denormalized (in token space, as the pipeline), decoded by the audio VAE to a
  mel spectrogram and by the vocoder to a waveform (`audio`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

from unirl.models.flow.config import check_frames, latent_frames
from unirl.models.flow.family import DiffusersBundle
from unirl.models.flow.guidance import ClassifierFreeGuidance, Uncond
from unirl.models.flow.loading import (
    check_scheduler_config,
    load_diffusers_checkpoint,
    pretrained_pipeline_options,
    tiny_qwen_tokenizer,
)
from unirl.models.ltx2.config import TinyLTX2Config


@dataclass(frozen=True)
class ExtraGuidance:
    """LTX2Pipeline's guidance terms beyond classifier-free guidance (`LTX2ModelConfig` documents
    each; an audio value of None takes the video's). All off by default."""

    stg_scale: float = 0.0
    audio_stg_scale: float | None = None
    stg_blocks: tuple[int, ...] | list[int] = ()
    modality_scale: float = 1.0
    audio_modality_scale: float | None = None
    guidance_rescale: float = 0.0
    audio_guidance_rescale: float | None = None

    def audio(self, name: str) -> float:
        value = getattr(self, "audio_" + name)
        return getattr(self, name) if value is None else value

    @property
    def stg(self) -> bool:
        return self.stg_scale > 0 or self.audio("stg_scale") > 0

    @property
    def modality(self) -> bool:
        return self.modality_scale > 1 or self.audio("modality_scale") > 1

    @property
    def rescale(self) -> bool:
        return self.guidance_rescale > 0 or self.audio("guidance_rescale") > 0

    @property
    def active(self) -> bool:
        return self.stg or self.modality or self.rescale


class LTX2Bundle(DiffusersBundle, ClassifierFreeGuidance):
    """The modules of one LTX-2 model plus the `LTX2Pipeline` that owns them.

    Attributes:
        pipeline: an `LTX2Pipeline`; its prompt encoder and connectors are the encoders of record.
        transformer: the `LTX2VideoTransformer3DModel` (the trainable module).
        vae, audio_vae, vocoder: the video VAE, the audio VAE and the vocoder.
        num_frames, frame_rate: the clip (the soundtrack lasts num_frames / frame_rate seconds).
        audio_frames: audio latent frames of a clip (the pipeline's rounding).
        audio_guidance_scale: the audio stream's guidance scale (None: the video's).
        extra: the pipeline's other guidance terms (`ExtraGuidance`; all off by default).
        sample_size: the frame side in pixels a tiny model is built for (a directory: 512, the
            pipeline's default height).
        audio_sample_rate: the vocoder's output rate in Hz.
    """

    TEXT_KEYS: ClassVar[tuple[str, ...]] = ("video_embeds", "audio_embeds", "text_mask")
    cond_keys = (*TEXT_KEYS, "grid")
    shared_keys = ("grid",)
    LORA_PIPELINE: ClassVar[type] = LTX2Pipeline
    # the prompt encoders: Gemma 3 and the text connectors (the connectors turn its states into each
    # stream's text tokens; both are frozen)
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors")
    PIPELINE: ClassVar[type] = LTX2Pipeline
    USE_CROSS_TIMESTEP: ClassVar[bool] = True  # the pipeline's default

    def __init__(
        self,
        pipeline: LTX2Pipeline,
        num_frames: int,
        frame_rate: float,
        sample_size: int,
        audio_guidance_scale: float | None = None,
        extra_guidance: dict | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.transformer: LTX2VideoTransformer3DModel = pipeline.transformer
        self.vae: AutoencoderKLLTX2Video = pipeline.vae
        self.audio_vae: AutoencoderKLLTX2Audio = pipeline.audio_vae
        self.vocoder: LTX2Vocoder = pipeline.vocoder
        self.temporal = int(pipeline.vae_temporal_compression_ratio)
        self.spatial = int(pipeline.vae_spatial_compression_ratio)
        config = self.transformer.config
        if config.patch_size != 1 or config.patch_size_t != 1:
            raise ValueError(
                f"this LTX-2 transformer patches {config.patch_size_t}x{config.patch_size}x{config.patch_size}: "
                "UniRL's LTX-2 family takes one token per latent cell (patch 1, as the released model)"
            )
        self.latent_channels = int(config.in_channels)
        self.mel_bins = int(self.audio_vae.config.mel_bins) // int(pipeline.audio_vae_mel_compression_ratio)
        audio_width = int(self.audio_vae.config.latent_channels) * self.mel_bins
        if audio_width != self.latent_channels or config.audio_in_channels != audio_width:
            raise ValueError(
                f"this LTX-2 model's audio tokens are {audio_width} wide (audio_vae latent_channels x mel bins / "
                f"{pipeline.audio_vae_mel_compression_ratio}) and its video tokens {self.latent_channels}: UniRL "
                "samples both streams in one latent, which needs them equal (the released model: 128 and 128)"
            )
        check_frames(num_frames, self.temporal, "this LTX-2 VAE")
        self.num_frames = num_frames
        self.frame_rate = float(frame_rate)
        seconds = num_frames / self.frame_rate
        per_second = (
            pipeline.audio_sampling_rate
            / pipeline.audio_hop_length
            / float(pipeline.audio_vae_temporal_compression_ratio)
        )
        self.audio_frames = round(seconds * per_second)
        if self.audio_frames < 1:
            raise ValueError(
                f"model.num_frames={num_frames} at model.frame_rate={frame_rate} lasts {seconds:.3f} s, shorter than "
                f"one audio latent frame ({1 / per_second:.3f} s): give more frames or a lower frame rate"
            )
        self.audio_guidance_scale = audio_guidance_scale
        self.extra = ExtraGuidance(**(extra_guidance or {}))
        blocks = len(self.transformer.transformer_blocks)
        if any(not 0 <= b < blocks for b in self.extra.stg_blocks):
            raise ValueError(
                f"model.stg_blocks={list(self.extra.stg_blocks)}: this LTX-2 transformer has blocks 0..{blocks - 1}"
            )
        if self.extra.stg and not getattr(self.transformer.config, "perturbed_attn", False):
            raise ValueError(
                "model.stg_scale / audio_stg_scale > 0, but this LTX-2 transformer was built without perturbable "
                "self-attention (its config's perturbed_attn is false), so STG would change nothing: set them to 0, "
                "or use a transformer with perturbed_attn: true (a tiny one: model.tiny.perturbed_attn=true)"
            )
        self.sample_size = sample_size
        self._decoded_grid: tuple[int, int, int] | None = None
        self.audio_sample_rate = int(self.vocoder.config.output_sampling_rate)
        self.freeze_frozen_modules()

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The prompt encoders, both VAEs and the vocoder."""
        return self.text_encoders() + [self.vae, self.audio_vae, self.vocoder]

    # ---- geometry ---------------------------------------------------------------------------
    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        if height % self.spatial or width % self.spatial:
            raise ValueError(
                f"sampling.height/width ({height}x{width}) must be multiples of {self.spatial} "
                "(the LTX-2 VAE's spatial scale: one token per latent cell)"
            )
        return self.latent_frames, height // self.spatial, width // self.spatial

    @property
    def latent_frames(self) -> int:
        """Latent frames of a clip: the first frame alone, then one per `temporal` frames."""
        return latent_frames(self.num_frames, self.temporal)

    def latent_shape(self, height: int, width: int) -> tuple[int, int]:
        """(C, N_v + N_a): C channels, the video's f x h x w tokens then the audio's frames. The
        grid is kept for `pixels` (the stage asks for the shape before it samples or decodes)."""
        f, h, w = self._grid(height, width)
        self._decoded_grid = (f, h, w)
        return self.latent_channels, f * h * w + self.audio_frames

    def image_seq_len(self, height: int, width: int) -> int:
        """Video tokens per clip, f x h x w (the pipeline's dynamic shift counts them alone)."""
        f, h, w = self._grid(height, width)
        return f * h * w

    def model_info(self) -> dict:
        """One token per latent cell (`patch_size` 1); the clip's `num_frames` and `latent_frames`
        (the schedule's token count is latent_frames x the cells of a frame) and the soundtrack's
        `audio_sample_rate` (a track of this family carries audio)."""
        return {
            "pixel_space": False,
            "vae_scale_factor": self.spatial,
            "patch_size": 1,
            "num_frames": self.num_frames,
            "latent_frames": self.latent_frames,
            "audio_sample_rate": self.audio_sample_rate,
        }

    def split(self, x: torch.Tensor, video_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(video [B, N_v, C], audio [B, N_a, C]) tokens, the pipeline's packed layout, of latents
        x [B, C, N_v + N_a]."""
        return x[..., :video_tokens].transpose(1, 2), x[..., video_tokens:].transpose(1, 2)

    # ---- network ----------------------------------------------------------------------------
    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """The pipeline's encoding: video_embeds [U, L, Dv] and audio_embeds [U, L, Da] from the
        connectors, their mask text_mask [U, L] (L = max_sequence_length); with `guided` the empty
        prompt's under `negative_` keys (the pipeline's default negative prompt)."""
        return self.encode_text_keys(prompts, guided, max_sequence_length)

    def _encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, ...]:
        pipe = self.pipeline
        embeds, mask = pipe._get_gemma_prompt_embeds(
            prompt=prompts, max_sequence_length=length, device=self.device
        )
        video, audio, text_mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        return video, audio, text_mask.to(video.dtype)

    def predict(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: dict,
        stg_blocks: list[int] | None = None,
        isolate_modalities: bool = False,
    ) -> torch.Tensor:
        """Velocity [B, C, N_v + N_a] at latents x [B, C, N_v + N_a] and sigma [B]: the network on
        both streams at timestep `sigma * 1000`, with the clip's geometry; `stg_blocks` perturbs
        those blocks' self-attention (STG's branch), `isolate_modalities` turns the audio-video
        cross-attention off (modality guidance's branch)."""
        dtype = next(module.parameters()).dtype
        f, h, w = self._grid_of(cond)
        video, audio = self.split(x.to(dtype), f * h * w)
        timestep = (sigma * 1000.0).to(dtype)
        mask = cond["text_mask"].to(dtype)
        v_video, v_audio = module(
            hidden_states=video, audio_hidden_states=audio,
            encoder_hidden_states=cond["video_embeds"].to(dtype), audio_encoder_hidden_states=cond["audio_embeds"].to(dtype),
            timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=f, height=h, width=w, fps=self.frame_rate, audio_num_frames=self.audio_frames,
            use_cross_timestep=self.USE_CROSS_TIMESTEP, isolate_modalities=isolate_modalities,
            spatio_temporal_guidance_blocks=stg_blocks, return_dict=False,
        )  # fmt: skip
        return torch.cat([v_video, v_audio], dim=1).transpose(1, 2)

    @torch.no_grad()
    def encode_conditions(self, req, guided: bool = False) -> dict[str, torch.Tensor]:
        """{"grid": [B, 3]}: each row's latent grid (frames, rows, columns) at the request's
        sampling size, which the token axis of a latent does not say; both branches read it, and it
        travels with the track's conditions into replay."""
        grid = torch.tensor(self._grid(req.sampling.height, req.sampling.width), dtype=torch.float32)
        return {"grid": grid.expand(len(req), 3).to(self.device)}

    def _grid_of(self, cond: dict) -> tuple[int, int, int]:
        if "grid" not in cond:
            raise ValueError(
                "LTX-2's network call needs cond['grid'] (the latent frames, rows and columns): encode a "
                "request with FlowMatchingStage.encode_request, which adds it"
            )
        if cond["grid"].is_meta and self._decoded_grid is not None:
            return self._decoded_grid  # planned on the meta device (unirl.plan_memory): latent_shape's grid
        f, h, w = (int(v) for v in cond["grid"][0].tolist())
        return f, h, w

    def guided_velocity(
        self, forward, x: torch.Tensor, sigma: torch.Tensor, cond: dict, scale: float, uncond: Uncond
    ) -> torch.Tensor:
        """The pipeline's guidance in x0 form (module doc). Each branch's x0 = x - sigma v; the
        guided x0 = x0_c + CFG + STG + modality deltas, in that order: (s - 1)(x0_c - x0_u) with
        the video's `scale` and `audio_guidance_scale` on the audio tokens (when `scale` > 1; the
        config refuses an audio scale > 1 beside an unguided video), stg (x0_c - x0_stg) and
        (m - 1)(x0_c - x0_mod) with the `extra` scales of each stream; then, per stream, the
        guidance rescale toward x0_c's standard deviation; back to a velocity (x - x0) / sigma,
        as the pipeline does, so that sampling equals it bit for bit. The STG and modality
        branches are cond-prompt forwards that follow `uncond.detach` as the uncond one does."""
        s = sigma.view(-1, 1, 1)
        extra = self.extra
        if scale <= 1.0:
            if self.audio_guidance_scale is not None and self.audio_guidance_scale > 1.0:
                raise ValueError(
                    f"model.audio_guidance_scale={self.audio_guidance_scale} needs sampling.guidance_scale > 1 "
                    f"(got {scale}): the stage encodes the uncond prompt only for a guided video"
                )
            if not extra.active:
                return (x - (x - forward(x, sigma, self.branch(cond)) * s)) / s
        positive = self.branch(cond)
        if scale > 1.0:
            v_uncond, v_cond = self.branches(forward, x, sigma, cond, uncond)
        else:
            v_cond = forward(x, sigma, positive)
        x0_cond = x - v_cond * s
        video_tokens = x.shape[-1] - self.audio_frames

        def gains(video: float, audio: float) -> torch.Tensor:
            out = torch.full((x.shape[-1],), video, dtype=x.dtype, device=x.device)
            out[video_tokens:] = audio
            return out

        x0 = x0_cond
        if scale > 1.0:
            audio_scale = self.audio_guidance_scale or scale
            x0 = x0 + gains(scale - 1.0, audio_scale - 1.0) * (x0_cond - (x - v_uncond * s))
        if extra.stg:
            with uncond.context():
                v_stg = forward(x, sigma, positive, stg_blocks=list(extra.stg_blocks))
            x0 = x0 + gains(extra.stg_scale, extra.audio("stg_scale")) * (x0_cond - (x - v_stg * s))
        if extra.modality:
            with uncond.context():
                v_mod = forward(x, sigma, positive, isolate_modalities=True)
            mod = gains(extra.modality_scale - 1.0, extra.audio("modality_scale") - 1.0)
            x0 = x0 + mod * (x0_cond - (x - v_mod * s))
        if extra.rescale:
            x0 = self.rescaled(x0, x0_cond, video_tokens)
        return (x - x0) / s

    def rescaled(self, x0: torch.Tensor, x0_cond: torch.Tensor, video_tokens: int) -> torch.Tensor:
        """The pipeline's `rescale_noise_cfg` of each stream's guided x0 toward its cond x0, on the
        pipeline's packed [B, tokens, C] layout (the standard deviations over a sample's tokens and
        channels reduce in its order)."""
        streams = []
        for part, rescale in (
            (slice(None, video_tokens), self.extra.guidance_rescale),
            (slice(video_tokens, None), self.extra.audio("guidance_rescale")),
        ):
            guided = x0[..., part].transpose(1, 2).contiguous()
            if rescale > 0:
                cond = x0_cond[..., part].transpose(1, 2).contiguous()
                guided = rescale_noise_cfg(guided, cond, guidance_rescale=rescale)
            streams.append(guided.transpose(1, 2))
        return torch.cat(streams, dim=-1)

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, F, 3, H, W] fp32 RGB frames in about [-1, 1] (unclamped), differentiable: the video
        tokens unpacked, denormalized by the VAE's latents mean / std and decoded (at decode
        timestep 0 when the VAE is timestep-conditioned, the pipeline's default)."""
        if self._decoded_grid is None:
            raise ValueError(
                "LTX2Bundle.pixels: call latent_shape(height, width) first (it pins the latent grid)"
            )
        f, h, w = self._decoded_grid
        if latents.shape[-1] != f * h * w + self.audio_frames:
            raise ValueError(
                f"LTX2Bundle.pixels: latents of {latents.shape[-1]} tokens, but the pinned grid {f}x{h}x{w} plus "
                f"{self.audio_frames} audio frames has {f * h * w + self.audio_frames}"
            )
        vae, pipe = self.vae, self.pipeline
        video = latents[..., : f * h * w].reshape(latents.shape[0], -1, f, h, w)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=vae.dtype)
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        return frames.float().transpose(1, 2)

    def audio(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, A, T] fp32 waveforms (A channels at `audio_sample_rate`, about [-1, 1]) from latents
        [B, C, N_v + N_a]: the audio tokens denormalized by the audio VAE's latents mean / std (token
        space, as the pipeline), unpacked to [B, C_a, L, M], decoded to a mel spectrogram and
        vocoded."""
        pipe, avae = self.pipeline, self.audio_vae
        tokens = latents[..., latents.shape[-1] - self.audio_frames :].transpose(1, 2)
        tokens = pipe._denormalize_audio_latents(tokens, avae.latents_mean, avae.latents_std)
        packed = pipe._unpack_audio_latents(tokens, self.audio_frames, num_mel_bins=self.mel_bins)
        mel = avae.decode(packed.to(avae.dtype), return_dict=False)[0]
        return self.vocoder(mel).float()

    # ---- building and saving ----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        num_frames: int,
        frame_rate: float,
        audio_guidance_scale: float | None = None,
        dtype: torch.dtype = torch.float32,
        extra_guidance: dict | None = None,
    ) -> LTX2Bundle:
        """Load a local diffusers LTX-2 directory (text-to-audio-video)."""
        if pretrained_pipeline_options(path):
            raise FileNotFoundError(f"model.pretrained_path {path!r} has no vae/: LTX-2 decodes with its VAE")
        pipe = cls.PIPELINE.from_pretrained(path, torch_dtype=dtype)
        check_scheduler_config(
            dict(pipe.scheduler.config), os.path.join(path, "scheduler"), reproduced=("shift_terminal",)
        )
        pipe.transformer.to(torch.float32)
        return cls(
            pipe, num_frames, frame_rate, sample_size=512, audio_guidance_scale=audio_guidance_scale,
            extra_guidance=extra_guidance,
        )  # fmt: skip

    @classmethod
    def tiny(
        cls,
        cfg: TinyLTX2Config,
        num_frames: int,
        frame_rate: float,
        audio_guidance_scale: float | None = None,
        extra_guidance: dict | None = None,
    ) -> LTX2Bundle:
        """A randomly initialized tiny model, deterministic in `cfg.seed`."""
        from transformers import Gemma3TextConfig, Gemma3TextModel

        torch.manual_seed(cfg.seed)
        tokenizer = tiny_qwen_tokenizer(cfg.words, "")
        width = cfg.text_hidden_size
        text_encoder = Gemma3TextModel(
            Gemma3TextConfig(
                vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=cfg.text_layers, num_attention_heads=2, num_key_value_heads=1,
                head_dim=width // 2, pad_token_id=tokenizer.pad_token_id,
            )
        ).eval()  # fmt: skip
        connectors = LTX2TextConnectors(
            caption_channels=width, text_proj_in_factor=cfg.text_layers + 1,
            video_connector_num_attention_heads=2, video_connector_attention_head_dim=width // 2,
            video_connector_num_layers=1, video_connector_num_learnable_registers=None,
            audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=width // 2,
            audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
            connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split",
        )  # fmt: skip
        vae = AutoencoderKLLTX2Video(
            latent_channels=cfg.latent_channels, block_out_channels=(cfg.vae_width,),
            decoder_block_out_channels=(cfg.vae_width,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
            upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
            encoder_causal=True, decoder_causal=False,
        )  # fmt: skip
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=cfg.audio_channels, ch_mult=(1,), num_res_blocks=1,
            in_channels=cfg.audio_channels, resolution=32, latent_channels=cfg.audio_latent_channels,
            mel_bins=cfg.mel_bins, sample_rate=16000, mel_hop_length=160,
        )  # fmt: skip
        vocoder = LTX2Vocoder(
            in_channels=cfg.audio_channels * cfg.mel_bins, hidden_channels=32, out_channels=cfg.audio_channels,
            upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]], output_sampling_rate=16000,
        )  # fmt: skip
        pipe = cls.PIPELINE(
            scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
            tokenizer=tokenizer, connectors=connectors, transformer=tiny_transformer(cfg), vocoder=vocoder,
        )  # fmt: skip
        return cls(
            pipe,
            num_frames,
            frame_rate,
            sample_size=cfg.resolution,
            audio_guidance_scale=audio_guidance_scale,
            extra_guidance=extra_guidance,
        )


def tiny_transformer(cfg: TinyLTX2Config) -> LTX2VideoTransformer3DModel:
    """The denoiser alone: `latent_channels` in and out on both streams, patch 1, positions scaled
    by the tiny VAE's (2, 2, 2) compression."""
    return LTX2VideoTransformer3DModel(
        in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads, attention_head_dim=cfg.attention_head_dim,
        cross_attention_dim=cfg.num_attention_heads * cfg.attention_head_dim, vae_scale_factors=(2, 2, 2),
        audio_in_channels=cfg.latent_channels, audio_out_channels=cfg.latent_channels,
        audio_num_attention_heads=cfg.audio_num_attention_heads, audio_attention_head_dim=cfg.audio_attention_head_dim,
        audio_cross_attention_dim=cfg.audio_num_attention_heads * cfg.audio_attention_head_dim,
        num_layers=cfg.num_layers, caption_channels=cfg.text_hidden_size, rope_double_precision=False,
        rope_type="split", perturbed_attn=cfg.perturbed_attn,
    )  # fmt: skip


def load_checkpoint(
    path: str, num_frames: int, frame_rate: float, audio_guidance_scale: float | None = None,
    dtype: torch.dtype = torch.float32, extra_guidance: dict | None = None,
) -> LTX2Bundle:  # fmt: skip
    """A bundle with the trained weights of a UniRL checkpoint directory: its `base_model` with the
    LoRA loaded by `LTX2Pipeline.load_lora_weights`, or the full `transformer/` directory."""
    return load_diffusers_checkpoint(
        path,
        lambda base: LTX2Bundle.from_pretrained(
            base,
            num_frames,
            frame_rate,
            audio_guidance_scale=audio_guidance_scale,
            dtype=dtype,
            extra_guidance=extra_guidance,
        ),  # fmt: skip
        LTX2VideoTransformer3DModel,
    )
