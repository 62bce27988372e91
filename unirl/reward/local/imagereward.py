"""ImageReward (Xu et al. 2023) from local files, without the `image-reward` package.

ImageReward is BLIP (a ViT image encoder and a BERT text encoder cross-attending to the image)
with an MLP head on the text encoder's first token; its checkpoint `ImageReward.pt` is a state dict
of `blip.visual_encoder.*` (BLIP's ViT), `blip.text_encoder.*` (its BERT) and `mlp.layers.*` (the
same five-Linear head as the LAION aesthetic predictor's, 768 -> 1 with no activations). The score
of an image is the package's `ImageReward.score`:

    (mlp(text_encoder(prompt tokens, cross-attending to vit(image)).last_hidden_state[:, 0]) - MEAN) / STD

with the prompt padded to 35 tokens by bert-base-uncased's tokenizer plus BLIP's `[DEC]` and
`[ENC]` tokens, and the image resized (shortest side, bicubic) and centre-cropped to the ViT's
size, scaled and normalised with CLIP's mean and std. Here the checkpoint is converted to
transformers' `BlipVisionModel` and `BlipTextModel` (`blip_to_hf`; the architecture is read from
the checkpoint's shapes, the head counts are BLIP-large's 16 and BERT-base's 12) and the image goes
through a `CLIPImageProcessor` configured as that transform. About -2..2; higher is preferred.
"""

from __future__ import annotations

import os
import re

import torch

from unirl.reward.local.aesthetic import LAYERS, aesthetic_mlp
from unirl.reward.local.files import require_file
from unirl.reward.placement import on_device_while_scoring
from unirl.types.reward import RewardRequest

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # the package's normalisation of the head's output
MAX_LENGTH = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_VIT_BLOCK = re.compile(r"^blip\.visual_encoder\.blocks\.(\d+)\.(.+)$")
_VIT_PARTS = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
              "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
_VIT_TOP = {
    "blip.visual_encoder.cls_token": "vision.embeddings.class_embedding",
    "blip.visual_encoder.pos_embed": "vision.embeddings.position_embedding",
    "blip.visual_encoder.patch_embed.proj.weight": "vision.embeddings.patch_embedding.weight",
    "blip.visual_encoder.patch_embed.proj.bias": "vision.embeddings.patch_embedding.bias",
    "blip.visual_encoder.norm.weight": "vision.post_layernorm.weight",
    "blip.visual_encoder.norm.bias": "vision.post_layernorm.bias",
}


def blip_to_hf(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """{"vision.*": BlipVisionModel, "text.*": BlipTextModel, "mlp.*": the head} from an
    ImageReward state dict; BLIP's unused parts (projections, ITM head, momentum encoders, queues)
    are dropped; a ViT key it does not know raises naming `where`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in _VIT_TOP:
            out[_VIT_TOP[key]] = value
        elif block := _VIT_BLOCK.match(key):
            module, _, leaf = block.group(2).rpartition(".")
            if module not in _VIT_PARTS:
                raise ValueError(f"{where}: {key!r} is not a key of BLIP's ViT block")
            out[f"vision.encoder.layers.{block.group(1)}.{_VIT_PARTS[module]}.{leaf}"] = value
        elif key.startswith("blip.visual_encoder."):
            raise ValueError(f"{where}: {key!r} is not a key of BLIP's ViT (is this ImageReward.pt?)")
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            out["mlp." + key.removeprefix("mlp.layers.")] = value
    return out


def configs(state: dict[str, torch.Tensor], vision_heads: int, text_heads: int, where: str):
    """(BlipVisionConfig, BlipTextConfig) of the converted `state`, read from its shapes."""
    from transformers import BlipTextConfig, BlipVisionConfig

    def need(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"{where}: no {key} (converted name); is this an ImageReward checkpoint?")
        return state[key]

    pos, patch = (
        need("vision.embeddings.position_embedding"),
        need("vision.embeddings.patch_embedding.weight"),
    )
    width, side = pos.shape[-1], patch.shape[-1]
    grid = int(round((pos.shape[1] - 1) ** 0.5))
    vision = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=need("vision.encoder.layers.0.mlp.fc1.weight").shape[0],
        num_hidden_layers=len({k.split(".")[3] for k in state if k.startswith("vision.encoder.layers.")}),
        num_attention_heads=vision_heads,
        image_size=grid * side,
        patch_size=side,
        layer_norm_eps=1e-6,  # BLIP's ViT (timm's partial(nn.LayerNorm, eps=1e-6))
    )
    words = need("text.embeddings.word_embeddings.weight")
    text = BlipTextConfig(
        vocab_size=words.shape[0],
        hidden_size=words.shape[1],
        encoder_hidden_size=need("text.encoder.layer.0.crossattention.self.key.weight").shape[1],
        intermediate_size=need("text.encoder.layer.0.intermediate.dense.weight").shape[0],
        num_hidden_layers=len({k.split(".")[3] for k in state if k.startswith("text.encoder.layer.")}),
        num_attention_heads=text_heads,
        max_position_embeddings=need("text.embeddings.position_embeddings.weight").shape[0],
        layer_norm_eps=1e-12,  # BERT's
    )
    for name, cfg, heads in (("vision", vision, vision_heads), ("text", text, text_heads)):
        if cfg.hidden_size % heads:
            raise ValueError(
                f"{where}: the {name} width {cfg.hidden_size} is not divisible by {name}_heads={heads}"
            )
    return vision, text


class ImageReward:
    """Scorer: ImageReward of each image against its prompt, [B] fp32 (module docstring).

    Args:
        checkpoint_path: `ImageReward.pt` (THUDM/ImageReward).
        tokenizer_path: a bert-base-uncased tokenizer directory (`[DEC]` and `[ENC]` are added, as
            BLIP's `init_tokenizer` does).
        vision_heads, text_heads: attention heads (BLIP-large's ViT: 16; BERT-base: 12).
        batch_size, device, dtype, offload: as `PickScore`'s.

    Missing files are named when the scorer is built; a checkpoint of another layout, or whose
    vocabulary is not the tokenizer's, fails its first call naming the file.
    """

    def __init__(
        self,
        checkpoint_path: str,
        tokenizer_path: str,
        vision_heads: int = 16,
        text_heads: int = 12,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        require_file("ImageReward", "checkpoint_path", checkpoint_path, "ImageReward.pt (THUDM/ImageReward)")
        if not any(os.path.isfile(os.path.join(tokenizer_path, f)) for f in ("vocab.txt", "tokenizer.json")):
            raise ValueError(
                f"ImageReward: tokenizer_path {tokenizer_path} holds no vocab.txt or tokenizer.json; "
                "it is bert-base-uncased's tokenizer directory"
            )
        if dtype not in ("float32", "bfloat16", "float16") or batch_size < 1:
            raise ValueError(
                f"ImageReward needs dtype float32 / bfloat16 / float16 and batch_size >= 1, got {dtype!r}, {batch_size}"
            )
        self.checkpoint_path, self.tokenizer_path = checkpoint_path, tokenizer_path
        self.vision_heads, self.text_heads = vision_heads, text_heads
        self.batch_size, self.device, self.dtype = batch_size, torch.device(device), getattr(torch, dtype)
        self.offload = bool(offload)
        self._parts = None

    def load(self):
        """(vision model, text model, head, tokenizer, image processor), loaded on first use."""
        if self._parts is None:
            from transformers import AutoTokenizer, CLIPImageProcessor
            from transformers.models.blip.modeling_blip import BlipVisionModel
            from transformers.models.blip.modeling_blip_text import BlipTextModel

            where = f"ImageReward {self.checkpoint_path}"
            try:
                raw = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
                raise ValueError(
                    f"{where}: not a readable torch checkpoint ({type(e).__name__}: {e})"
                ) from None
            state = blip_to_hf(raw.get("state_dict", raw) if isinstance(raw, dict) else {}, where)
            vision_cfg, text_cfg = configs(state, self.vision_heads, self.text_heads, where)
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            tokenizer.add_special_tokens({"bos_token": "[DEC]"})
            tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
            if len(tokenizer) != text_cfg.vocab_size:
                raise ValueError(
                    f"{where}: the text encoder has {text_cfg.vocab_size} token embeddings but the tokenizer of "
                    f"{self.tokenizer_path} with [DEC] and [ENC] has {len(tokenizer)}; use bert-base-uncased's"
                )
            vision, text = BlipVisionModel(vision_cfg), BlipTextModel(text_cfg, add_pooling_layer=False)
            head = aesthetic_mlp(text_cfg.hidden_size)
            for prefix, module in (("vision.", vision), ("text.", text), ("mlp.", head)):
                part = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
                if prefix == "mlp.":
                    want = {f"{n.removeprefix('layers.')}.{p}" for n in LAYERS for p in ("weight", "bias")}
                    if set(part) != want:
                        raise ValueError(
                            f"{where}: the head's keys are {sorted(part)[:6]}, not mlp.layers.{{0,2,4,6,7}}"
                        )
                try:
                    module.load_state_dict(part, strict=True)
                except RuntimeError as e:
                    raise ValueError(f"{where}: the {prefix[:-1]} weights do not fit: {e}") from None
            home = "cpu" if self.offload else self.device
            modules = [m.eval().requires_grad_(False).to(home, self.dtype) for m in (vision, text, head)]
            side = vision_cfg.image_size
            processor = CLIPImageProcessor(
                size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD),
            )  # fmt: skip
            self._parts = (*modules, tokenizer, processor)
        return self._parts

    @torch.no_grad()
    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        from PIL import Image

        images = req.require_images("ImageReward")
        vision, text, head, tokenizer, processor = self.load()
        out = []
        with on_device_while_scoring(self.device, self.offload, vision, text, head):
            for i in range(0, len(images), self.batch_size):
                pil = [
                    Image.fromarray(im.permute(1, 2, 0).numpy())
                    for im in images[i : i + self.batch_size].cpu()
                ]
                pixels = processor(images=pil, return_tensors="pt")["pixel_values"].to(
                    self.device, self.dtype
                )
                tokens = tokenizer(
                    req.prompts[i : i + self.batch_size], padding="max_length", truncation=True,
                    max_length=MAX_LENGTH, return_tensors="pt",
                )  # fmt: skip
                image_embeds = vision(pixel_values=pixels).last_hidden_state
                hidden = text(
                    input_ids=tokens["input_ids"].to(self.device),
                    attention_mask=tokens["attention_mask"].to(self.device),
                    encoder_hidden_states=image_embeds,
                    encoder_attention_mask=torch.ones(
                        image_embeds.shape[:-1], dtype=torch.long, device=self.device
                    ),
                ).last_hidden_state
                out.append(
                    ((head(hidden[:, 0].float().to(self.dtype)).squeeze(1).float() - MEAN) / STD).cpu()
                )
        return torch.cat(out)
