"""Qwen-Image-Edit-Plus: Qwen-Image that edits one or several reference images
(`QwenImageEditPlusPipeline`, the Qwen-Image-Edit-2509 / 2511 checkpoints).

The same transformer, VAE, packing and true CFG as Qwen-Image (`bundle.py`); what differs is the
condition. Each prompt row names its reference images (`metadata[condition_key]`, a list of one
or more paths, arrays or PIL images, resolved against the prompt file like a vision-language
row's). For each row, once per request (`encode_conditions`), as the pipeline does for its one
prompt:
- the prompt encoder *sees* the references: the edit template with "Picture k:" and the vision
  tokens of every reference, the references resized to `condition_area` pixels (the pipeline's
  `CONDITION_IMAGE_SIZE`, 384 x 384) and read by Qwen2.5-VL's vision tower; the hidden states
  after the template's 64 system tokens condition the transformer (so the bundle's prompt
  encoding is its conditions' encoding: `prompt_reads_conditions`);
- each reference resized to `vae_area` pixels (the pipeline's `VAE_IMAGE_SIZE`, 1024 x 1024; the
  side ratio kept, sides rounded to multiples of 32: `calculate_dimensions`) is encoded by the
  VAE (its mode, normalised by the latents' mean / std), packed 2x2, and its tokens follow the
  sample's in every network call, each image with its own (1, rows, cols) in `img_shapes`; the
  velocity is read from the sample's tokens.

The references travel with the track as conditions (`image_latents` [B, T_ref, 4C] packed,
`image_shapes` [B, n, 2] their packed rows and columns; both branches of the true CFG read them:
`shared_keys`), so replay, kept graphs, every transport and resume see them; the reward sees the
row's paths in the metadata. A request batches its rows, so every row of a prompt file gives the
same number of references with the same packed sizes (`QwenImageEditPlusModelConfig.condition_problems`).

A tiny pixel-space model (no VAE; the sample and its references are packed RGB) runs through the
same code with the VAE encode the identity; the pipeline itself needs a VAE, so parity is checked
in latent space.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from unirl.models.causal_lm.tiny import TinyVLMConfig, tiny_image_processor
from unirl.models.flow.loading import tiny_qwen_tokenizer
from unirl.models.flow.packing import pack
from unirl.models.images import metadata_images
from unirl.models.qwenimage import bundle as qwenimage
from unirl.models.qwenimage.bundle import QwenImageBundle, tiny_transformer  # noqa: F401 (the tiny denoiser: Qwen-Image's)
from unirl.models.qwenimage.config import TinyQwenImageConfig
from unirl.types import RolloutReq

EDIT_TEMPLATE_WORDS = (
    "system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image that "
    "meets the user's requirements while maintaining consistency with the original input where appropriate."
    "\nuser\nassistant\nPicture 1: 2: 3: 4:"
)
"""The words of QwenImageEditPlusPipeline's prompt template and its "Picture k:" labels: whole
tokens of the tiny tokenizer, so the system prefix is the 64 tokens the pipeline drops, as with
Qwen2.5-VL's own tokenizer."""

CONDITION_KEY = "images"
"""The default prompt-row metadata key naming a sample's references."""


def reference_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) a reference of `width` x `height` px is resized to for `area` pixels: the
    pipeline's `calculate_dimensions` (the side ratio kept, sides multiples of 32)."""
    return calculate_dimensions(area, width / height)


PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""The pipeline's label of the k-th reference in the prompt (its `_get_qwen_prompt_embeds`)."""


def encoded_prompt_lengths(
    processor: Qwen2VLProcessor, rows: list[tuple[str, list]], condition_area: int
) -> list[int]:
    """Tokens of the prompt encoder's conditioning for each (prompt, references) of `rows`: the
    pipeline's template around a "Picture k:" label and the vision tokens of each reference
    resized to `condition_area` pixels, less the template's dropped system tokens (what
    `sampling.max_sequence_length` must hold). Reads no weights."""
    pipe = QwenImageEditPlusPipeline(
        **dict.fromkeys(("scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer"))
    )  # only its template
    lengths = []
    for prompt, images in rows:
        labels = "".join(PICTURE.format(k + 1) for k in range(len(images)))
        seen = [image.resize(reference_size(condition_area, *image.size)) for image in images]
        ids = processor(text=[pipe.prompt_template_encode.format(labels + prompt)], images=seen).input_ids[0]
        lengths.append(len(ids) - pipe.prompt_template_encode_start_idx)
    return lengths


def edit_processor(pretrained_path: str | None, tiny: TinyQwenImageConfig | None) -> Qwen2VLProcessor:
    """The processor of a model config's source, no weights read: a directory's `processor/`, or
    the tiny model's (its tokenizer and the tiny Qwen2.5-VL's image processor)."""
    if pretrained_path:
        return StillImageQwenVLProcessor.from_pretrained(os.path.join(pretrained_path, "processor"))
    tokenizer = tiny_qwen_tokenizer(tiny.words, EDIT_TEMPLATE_WORDS)
    return StillImageQwenVLProcessor(
        tiny_image_processor(TinyVLMConfig(architecture="qwen2_5_vl")), tokenizer
    )


class StillImageQwenVLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` over still images only: its image processor and tokenizer, no video
    processor. transformers resolves a video processor's class through torchvision, which this
    install leaves out (the vLLM CPU build's CUDA torchvision breaks transformers' image imports on
    torch+cpu); an edit's prompt encoder reads images only. `from_pretrained` of a pipeline's `processor/` reads those two parts."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class QwenImageEditPlusBundle(QwenImageBundle):
    """A Qwen-Image-Edit-Plus model: `QwenImageBundle` over a `QwenImageEditPlusPipeline`,
    conditioned on the references of each sample's row.

    Attributes (beyond `QwenImageBundle`'s):
        condition_key: the metadata key of a row's references (set by the config).
        condition_area: pixels of a reference as the prompt encoder sees it.
        vae_area: pixels of a reference as the VAE encodes it.
    """

    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "image_latents", "image_shapes")
    shared_keys = ("image_latents", "image_shapes")
    prompt_reads_conditions = True
    LORA_PIPELINE: ClassVar[type] = QwenImageEditPlusPipeline
    PIPELINE: ClassVar[type] = QwenImageEditPlusPipeline
    TEMPLATE: ClassVar[str] = EDIT_TEMPLATE_WORDS
    condition_key: str = CONDITION_KEY

    def __init__(
        self,
        pipeline: QwenImageEditPlusPipeline,
        sample_size: int,
        negative_prompt: str | None = " ",
        condition_area: int = CONDITION_IMAGE_SIZE,
        vae_area: int = VAE_IMAGE_SIZE,
    ) -> None:
        super().__init__(pipeline, sample_size, negative_prompt)
        self.condition_area = condition_area
        self.vae_area = vae_area

    # ---- conditions -------------------------------------------------------------------------
    def references(self, metadata: dict[str, Any], sample_id: str) -> list:
        """The PIL images of a row's `condition_key` (one or more); errors name the sample."""
        need = "Qwen-Image-Edit-Plus edits one or more reference images"
        return metadata_images(metadata, self.condition_key, sample_id, need)

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq, guided: bool) -> dict[str, torch.Tensor]:
        """Per-sample prompt_embeds [B, L, D] and prompt_embeds_mask [B, L] (L =
        `max_sequence_length`; with `guided` their `negative_` twins, the negative prompt read
        with the same references), image_latents [B, T_ref, 4C] and image_shapes [B, n, 2], all
        fp32. Each row (the samples of a group share it) is encoded once, alone, as the pipeline
        encodes its one prompt: the references resized for the prompt encoder and for the VAE,
        each reference VAE-encoded on its own. Errors name the sample."""
        first = req.group_firsts()
        rows = {group: self._encode_row(req, i, guided) for group, i in first.items()}
        shapes = {group: row["image_latents"].shape for group, row in rows.items()}
        if len(set(shapes.values())) > 1:
            (a, sa), (b, sb) = list(shapes.items())[:2]
            raise ValueError(
                f"sample {req.sample_ids[first[b]]!r}: its references pack into {tuple(sb[1:])} tokens beside "
                f"{tuple(sa[1:])} of sample {req.sample_ids[first[a]]!r} in the same request; give every row of "
                "a prompt file the same number of references with the same side ratios"
            )
        return {k: torch.cat([rows[g][k] for g in req.group_ids]) for k in rows[req.group_ids[0]]}

    def _encode_row(self, req: RolloutReq, i: int, guided: bool) -> dict[str, torch.Tensor]:
        sid, max_len = req.sample_ids[i], req.sampling.max_sequence_length
        images = self.references(req.metadata[i], sid)
        processor = self.pipeline.image_processor
        seen, latents, shapes = [], [], []
        for image in images:
            w, h = reference_size(self.condition_area, *image.size)
            seen.append(processor.resize(image, h, w))
            w, h = reference_size(self.vae_area, *image.size)
            if not w or not h:
                raise ValueError(
                    f"sample {sid!r}: a reference of {image.width}x{image.height} px resizes to {w}x{h} px for "
                    f"the VAE (model.vae_area={self.vae_area}); give references closer to square"
                )
            dtype = torch.float32 if self.vae is None else self.vae.dtype
            pixels = processor.preprocess(image, h, w).unsqueeze(2).to(self.device, dtype)
            latents.append(pack(self._vae_latents(pixels)[:, :, 0]))
            shapes.append([h // self.vae_scale_factor // 2, w // self.vae_scale_factor // 2])
        out = {
            "image_latents": torch.cat(latents, dim=1).float(),
            "image_shapes": torch.tensor([shapes], dtype=torch.float32, device=self.device),
        }
        prompts = {"": req.prompts[i]}
        if guided:
            if self.negative_prompt is None:
                raise ValueError(
                    "Qwen-Image's true CFG needs a negative prompt: set model.negative_prompt or "
                    "sampling.guidance_scale: 1.0"
                )
            prompts["negative_"] = self.negative_prompt
        for prefix, prompt in prompts.items():
            pe, mask = self.pipeline.encode_prompt(prompt=[prompt], image=seen, device=self.device)
            length = pe.shape[1]
            if length > max_len:
                raise ValueError(
                    f"sample {sid!r}: the prompt with its {len(images)} reference(s) encodes to {length} tokens "
                    f"(each reference's vision tokens count), over sampling.max_sequence_length={max_len}; raise it"
                )
            mask = (
                torch.ones(1, length, dtype=torch.long, device=pe.device)
                if mask is None
                else mask.to(torch.long)
            )
            out[prefix + "prompt_embeds"] = torch.nn.functional.pad(pe, (0, 0, 0, max_len - length)).float()
            out[prefix + "prompt_embeds_mask"] = torch.nn.functional.pad(mask, (0, max_len - length)).float()
        return out

    def _vae_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, 1, h, w]: the VAE's mode of [1, 3, 1, H, W] pixels in [-1, 1], normalised by the
        latents' per-channel mean and std (the pipeline's `_encode_vae_image`); the pixels
        themselves in pixel space."""
        vae = self.vae
        if vae is None:
            return pixels
        latents = vae.encode(pixels).latent_dist.mode()
        view = (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(latents)
        std = torch.tensor(vae.config.latents_std).view(view).to(latents)
        return (latents - mean) / std

    def image_tokens(self, x: torch.Tensor, cond: dict) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The sample's packed latents, then every reference's, with each reference's (1, rows,
        cols) after the sample's in `img_shapes`."""
        tokens, shapes = super().image_tokens(x, cond)
        references = [(1, int(r), int(c)) for r, c in cond["image_shapes"][0].tolist()]
        return torch.cat([tokens, cond["image_latents"].to(tokens.dtype)], dim=1), shapes + references

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def pretrained_modules(cls, path: str) -> dict:
        """The directory's `processor/` as a `StillImageQwenVLProcessor` (its image processor and
        tokenizer; see the class)."""
        return {"processor": StillImageQwenVLProcessor.from_pretrained(os.path.join(path, "processor"))}

    @classmethod
    def tiny_modules(cls, cfg: TinyQwenImageConfig) -> dict:
        """Qwen-Image's tiny modules plus the processor: the tiny Qwen2.5-VL's image processor
        (patch 14, merge 2, its pixel bounds) over the tiny tokenizer."""
        modules = super().tiny_modules(cfg)
        vision = TinyVLMConfig(architecture="qwen2_5_vl")  # the tiny encoder's patch sizes and pixel bounds
        modules["processor"] = StillImageQwenVLProcessor(tiny_image_processor(vision), modules["tokenizer"])
        return modules


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32, **options) -> QwenImageEditPlusBundle:
    """The bundle of a UniRL checkpoint of an edit run (Qwen-Image's `load_checkpoint` into this
    bundle: its LoRA through `QwenImageEditPlusPipeline.load_lora_weights`); `options` are the
    bundle's (negative prompt, condition settings)."""
    return qwenimage.load_checkpoint(path, dtype, bundle_class=QwenImageEditPlusBundle, **options)
