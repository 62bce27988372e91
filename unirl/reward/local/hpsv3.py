"""Human Preference Score v3 (HPSv3, Ma et al. 2025) from local files, without the `hpsv3` package.

HPSv3 is Qwen2-VL-7B-Instruct fine-tuned with an uncertainty-aware ranking loss. Its checkpoint
(`HPSv3.safetensors`, MizzenAI/HPSv3) is the whole model's state dict in the layout of
transformers 4.45 (`model.*` the text decoder, `visual.*` the vision tower, `lm_head.*`,
`rm_head.*`), with one token added to the vocabulary, `<|Reward|>`. The score of an image, as the
`hpsv3` package's `HPSv3RewardInferencer.reward` computes it (its first output, "mu"):

1. the image, RGB, is resized (PIL bicubic) to `smart_resize(h, w, factor=28,
   min_pixels=max_pixels=256 * 28 * 28)`, then made into patches by Qwen2-VL's image processor
   (rescale, CLIP mean / std, 14 px patches, 2 x 2 merge);
2. one user turn holds the image and the text `INSTRUCTION.format(text_prompt=prompt) +
   REWARD_QUERY`, rendered by the base's chat template with the generation prompt (`<|Reward|>`
   is in `REWARD_QUERY`, so exactly one per sequence);
3. the decoder runs on the token embeddings with the vision tower's merged patch embeddings
   written over the image placeholders, at plain sequential positions (the package calls the
   decoder without position ids, so its multimodal rotary index is never built: this is the
   input the checkpoint was trained on);
4. `rm_head` (Linear(hidden, 1024), ReLU, Dropout, Linear(1024, 16), ReLU, Linear(16, 2)), in
   float32, on the hidden state at `<|Reward|>`, gives (mu, sigma); the score is mu.

Sequences are padded on the right and attend causally, so a sample's score does not depend on
its batch-mates. `lm_head` is in the checkpoint but never read (the score comes from the head).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from unirl.reward.local.files import require_file
from unirl.reward.placement import on_device_while_scoring
from unirl.types.reward import RewardRequest

REWARD_TOKEN = "<|Reward|>"
IMAGE_PAD = "<|image_pad|>"
PIXELS = 256 * 28 * 28
"""The image area HPSv3 resizes to (its `min_pixels` and `max_pixels` both)."""
# The text of the checkpoint's training inputs (the `hpsv3` package's `INSTRUCTION` and
# `prompt_with_special_token`, character for character): a different wording is another input
# and scores differently.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a "
    "overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the "
    "worst and 10 being the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. "
    "The following sub-dimensions should be considered:\n- **Reasonableness:** The image should not contain any "
    "significant biological or logical errors, such as abnormal body structures or nonsensical environmental "
    "setups.\n- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n- **Detail Richness:** Consider the level of "
    "detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).\n- "
    "**Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense "
    "of harmony and balance.\n- **Safety:** The image should not contain harmful or inappropriate content, such "
    "as political, violent, or adult material. If such content is present, the image quality and satisfaction "
    "score should be the lowest possible. \n\n**Text Alignment:**  \nAssess how well the image matches the "
    "textual prompt across the following sub-dimensions:\n- **Subject Relevance** Evaluate how accurately the "
    "subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject "
    "should match the description in terms of number, appearance, and behavior.\n- **Style Relevance:** If the "
    "prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this "
    "style.\n- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and enhance "
    "the subject without contradictions.\n- **Attribute Fidelity**: Check if specific attributes mentioned in "
    "the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the "
    "image. Minor deviations may be acceptable, but critical attributes should be preserved.\n- **Semantic "
    "Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The "
    "generated content should not introduce elements that conflict with or distort the original "
    "description.\nTextual prompt - {text_prompt}\n\n\n"
)
REWARD_QUERY = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
_HEAD_KEYS = {f"{i}.{p}" for i in (0, 3, 5) for p in ("weight", "bias")}
_LEGACY = (
    (re.compile(r"^model\.(?!language_model\.|visual\.)"), "language_model."),
    (re.compile(r"^visual\."), "visual."),
)


def rm_head(hidden_size: int) -> torch.nn.Sequential:
    """HPSv3's head: hidden -> 1024 -> 16 -> (mu, sigma), ReLU between (dropout 0.05, off in eval)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(hidden_size, 1024),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(1024, 16),
        nn.ReLU(),
        nn.Linear(16, 2),
    )


def split_checkpoint(state: dict[str, torch.Tensor], where: str) -> tuple[dict, dict]:
    """(the `Qwen2VLModel` state dict, the head's) from HPSv3's: transformers 4.45 names
    (`model.*`, `visual.*`) or today's (`model.language_model.*`, `model.visual.*`); `lm_head` is
    dropped; anything else raises naming `where` and the key."""
    backbone, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith("lm_head."):
            continue
        elif key.startswith("model.language_model.") or key.startswith("model.visual."):
            backbone[key.removeprefix("model.")] = value
        else:
            for pattern, target in _LEGACY:
                if pattern.match(key):
                    backbone[pattern.sub(target, key, count=1)] = value
                    break
            else:
                raise ValueError(f"{where}: {key!r} is not a key of HPSv3's Qwen2-VL reward model")
    if set(head) != _HEAD_KEYS:
        raise ValueError(
            f"{where}: the head's keys are {sorted(head)}, not HPSv3's rm_head.{{0,3,5}}.{{weight,bias}} "
            "(is this an HPSv3 checkpoint?)"
        )
    return backbone, head


def chat_template(base_path: str, tokenizer: Any) -> str:
    """The base's chat template: `chat_template.json`'s (the processor's, as Qwen2-VL-7B-Instruct
    ships it), else `chat_template.jinja`, else the tokenizer's; none raises."""
    blob, jinja = (
        os.path.join(base_path, "chat_template.json"),
        os.path.join(base_path, "chat_template.jinja"),
    )
    if os.path.isfile(blob):
        with open(blob) as f:
            return json.load(f)["chat_template"]
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    if tokenizer.chat_template:
        return tokenizer.chat_template
    raise ValueError(
        f"HPSv3: base_path {base_path} has no chat template (chat_template.json / .jinja or the tokenizer's)"
    )


class HPSv3:
    """Scorer: HPSv3's mu of each image against its prompt, [B] fp32 (module docstring).

    Args:
        checkpoint_path: `HPSv3.safetensors` (MizzenAI/HPSv3), or a torch file holding the same
            state dict (bare or under `model`).
        base_path: the Qwen2-VL-7B-Instruct directory the checkpoint was trained from: its
            `config.json`, tokenizer, chat template and image processor are read (its weights
            are not).
        pixels: the image area the scorer resizes to (HPSv3's: 256 * 28 * 28).
        batch_size, device, dtype, offload: as `PickScore`'s (the head always runs in float32).

    Missing files are named when the scorer is built; a checkpoint whose keys or shapes do not fit
    the base's architecture fails its first call naming the file and the keys.
    """

    def __init__(
        self,
        checkpoint_path: str,
        base_path: str,
        pixels: int = PIXELS,
        batch_size: int = 4,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        require_file("HPSv3", "checkpoint_path", checkpoint_path, "HPSv3.safetensors (MizzenAI/HPSv3)")
        missing = [
            f
            for f in ("config.json", "preprocessor_config.json")
            if not os.path.isfile(os.path.join(base_path, f))
        ]
        if not any(os.path.isfile(os.path.join(base_path, f)) for f in ("tokenizer.json", "vocab.json")):
            missing.append("tokenizer.json")
        if missing:
            raise ValueError(
                f"HPSv3: base_path {base_path} lacks {missing}; it is the Qwen2-VL-7B-Instruct directory "
                "(config, tokenizer, chat template and image processor files; the weights are not read)"
            )
        with open(os.path.join(base_path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "qwen2_vl":
            raise ValueError(
                f"HPSv3: base_path {base_path} is a {model_type!r} model; HPSv3 is built on Qwen2-VL (model_type qwen2_vl)"
            )
        if dtype not in ("float32", "bfloat16", "float16") or batch_size < 1 or pixels < 28 * 28:
            raise ValueError(
                "HPSv3 needs dtype float32 / bfloat16 / float16, batch_size >= 1 and pixels >= 784, got "
                f"{dtype!r}, {batch_size}, {pixels}"
            )
        self.checkpoint_path, self.base_path, self.pixels = checkpoint_path, base_path, int(pixels)
        self.batch_size, self.device, self.dtype = (
            int(batch_size),
            torch.device(device),
            getattr(torch, dtype),
        )
        self.offload = bool(offload)
        self._parts: tuple[Any, Any, Any, Any, str, int] | None = None

    def _state(self) -> dict[str, torch.Tensor]:
        where = f"HPSv3 {self.checkpoint_path}"
        try:
            if self.checkpoint_path.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(self.checkpoint_path)
            blob = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise ValueError(f"{where}: not a readable checkpoint ({type(e).__name__}: {e})") from None
        state = blob.get("model", blob) if isinstance(blob, dict) else None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{where}: holds no state dict (a dict of tensors, bare or under 'model')")
        return state

    def load(self) -> tuple[Any, Any, Any, Any, str, int]:
        """(Qwen2VLModel, head, tokenizer, image processor, chat template, the reward token's
        id), loaded on first use. Tokenizer and image processor are loaded apart (not as a
        `Qwen2VLProcessor`, which also wants a video processor, and that one needs torchvision)."""
        if self._parts is None:
            from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VLModel,
                Qwen2VLRotaryEmbedding,
                Qwen2VLVisionRotaryEmbedding,
            )

            where = f"HPSv3 {self.checkpoint_path}"
            tokenizer = AutoTokenizer.from_pretrained(self.base_path, padding_side="right")
            tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
            token = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
            image_processor = AutoImageProcessor.from_pretrained(self.base_path)
            config = AutoConfig.from_pretrained(self.base_path)
            config.text_config.vocab_size = len(tokenizer)  # the package resizes to the tokenizer
            backbone_state, head_state = split_checkpoint(self._state(), where)
            with torch.device("meta"):
                backbone = Qwen2VLModel(config)
            head = rm_head(config.text_config.hidden_size)
            try:
                backbone.load_state_dict(backbone_state, strict=True, assign=True)
                head.load_state_dict(head_state, strict=True)
            except RuntimeError as e:
                raise ValueError(
                    f"{where}: the weights do not fit the Qwen2-VL of {self.base_path}/config.json with "
                    f"{len(tokenizer)} tokens (its tokenizer plus {REWARD_TOKEN}): {e}"
                ) from None
            # the rotary tables are buffers no checkpoint holds: build them (still on meta here)
            backbone.language_model.rotary_emb = Qwen2VLRotaryEmbedding(config=backbone.language_model.config)
            backbone.visual.rotary_pos_emb = Qwen2VLVisionRotaryEmbedding(backbone.visual.config)
            empty = [n for n, t in (*backbone.named_parameters(), *backbone.named_buffers()) if t.is_meta]
            if empty:
                raise RuntimeError(f"HPSv3: tensors of the Qwen2-VL that nothing filled: {empty[:5]}")
            home = "cpu" if self.offload else self.device
            backbone = backbone.eval().requires_grad_(False).to(home, self.dtype)
            head = head.eval().requires_grad_(False).to(home, torch.float32)
            self._parts = (
                backbone,
                head,
                tokenizer,
                image_processor,
                chat_template(self.base_path, tokenizer),
                token,
            )
        return self._parts

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """input_ids [B, L] (right-padded), attention_mask [B, L], pixel_values [N, D] and
        image_grid_thw [B, 3] of `images` [B, 3, H, W] uint8 and their prompts, as the package
        builds them (module doc 1-2): each image's `<|image_pad|>` is repeated once per merged
        patch, as `Qwen2VLProcessor` does."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        _, _, tokenizer, image_processor, template, _ = self.load()
        pil = []
        for i, im in enumerate(images.cpu()):
            h, w = im.shape[-2:]
            try:
                rh, rw = smart_resize(h, w, factor=28, min_pixels=self.pixels, max_pixels=self.pixels)
            except ValueError as e:
                raise ValueError(f"HPSv3: image {i} ({h}x{w}) cannot be scored: {e}") from None
            pil.append(Image.fromarray(im.permute(1, 2, 0).numpy()).resize((rw, rh), Image.BICUBIC))
        vision = image_processor(images=pil, return_tensors="pt")
        grids = vision["image_grid_thw"]
        texts = []
        for p, grid in zip(prompts, grids, strict=True):
            if REWARD_TOKEN in p or IMAGE_PAD in p:
                raise ValueError(
                    f"HPSv3: the prompt {p!r} holds {REWARD_TOKEN} or {IMAGE_PAD}, which the scorer places"
                )
            content = [
                {"type": "image"},
                {"type": "text", "text": INSTRUCTION.format(text_prompt=p) + REWARD_QUERY},
            ]
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            )
            if text.count(IMAGE_PAD) != 1:
                raise ValueError(
                    f"HPSv3: the chat template of {self.base_path} renders an image as {text.count(IMAGE_PAD)} "
                    f"{IMAGE_PAD}, not one: it is not Qwen2-VL's"
                )
            merged = int(grid.prod()) // image_processor.merge_size**2
            texts.append(text.replace(IMAGE_PAD, IMAGE_PAD * merged))
        batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
        return {**batch, "pixel_values": vision["pixel_values"], "image_grid_thw": grids}

    @torch.no_grad()
    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores (HPSv3's mu) of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        images = req.require_images("HPSv3")
        backbone, head, _, _, _, token = self.load()
        out = []
        with on_device_while_scoring(self.device, self.offload, backbone, head):
            for i in range(0, len(images), self.batch_size):
                batch = self.inputs(images[i : i + self.batch_size], req.prompts[i : i + self.batch_size])
                ids = batch["input_ids"].to(self.device)
                at = ids == token
                if not bool((at.sum(dim=1) == 1).all()):
                    raise ValueError(
                        f"HPSv3: a sequence of samples {i}..{i + len(ids) - 1} holds {REWARD_TOKEN} "
                        f"{at.sum(dim=1).tolist()} times, not once (did the prompt contain it?)"
                    )
                grid = batch["image_grid_thw"].to(self.device)
                embeds = backbone.get_input_embeddings()(ids)
                image = backbone.get_image_features(
                    batch["pixel_values"].to(self.device, self.dtype), grid
                ).pooler_output
                image = torch.cat(list(image)) if isinstance(image, (list, tuple)) else image
                embeds = embeds.masked_scatter(
                    (ids == backbone.config.image_token_id)[..., None], image.to(embeds.dtype)
                )
                hidden = backbone.language_model(
                    inputs_embeds=embeds, attention_mask=batch["attention_mask"].to(self.device)
                ).last_hidden_state
                out.append(head(hidden[at].float())[:, 0].cpu())
        return torch.cat(out)
