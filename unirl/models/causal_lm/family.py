"""What a text family gives the shared text stage (`CausalLMStage`): the contract a causal-LM
bundle implements, as `unirl.models.flow.family.FlowFamily` is the diffusion families' one, and
`TextBundle`, the transformers plumbing the families' bundles share.

Structural typing (no base class to inherit): `unirl.models.qwen.QwenBundle` (Qwen3 / Qwen2),
`unirl.models.qwen_vl.QwenVLBundle` (Qwen2.5-VL / Qwen3-VL) and `unirl.models.janus.JanusBundle`
(Janus's text side) satisfy it, and a new text family is a bundle with these members. The stage checks a bundle against it when built
(`text_family_problems`), so a bundle that lacks a member is refused naming it, not failed on
deep inside a rollout.

Shapes: B samples, L tokens, N image patches of a sample, D the flattened patch length, k the
sample's images.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from unirl.models.causal_lm.loading import encode_pairs
from unirl.models.stage import module_device

IMAGE_PLACEHOLDER = "<image>"  # marks an image in a prompt, once per image (`VisionTextFamily.prepare`)


@runtime_checkable
class TextFamily(Protocol):
    """A causal LM and its tokenizer, as the text stage reads them.

    - `model`: the Hugging Face causal LM (its `config.get_text_config()` holds
      `max_position_embeddings`; `get_input_embeddings()` its vocabulary rows); the train
      backend wraps it (LoRA / FSDP2) in place of the stage's `module`.
    - `tokenizer`: a fast tokenizer with `eos_token_id` (ends a response) and `pad_token_id`
      (pads a batch) set, and a chat template when recipes ask for one.
    - `has_vision`: whether prompts may carry images (then the bundle is a `VisionTextFamily`).
    - `vision_token_ids`: token ids a response must never hold (a VLM's image placeholders, a
      unified model's image delimiters), masked out of sampling; () for a text-only model.
    """

    model: torch.nn.Module
    tokenizer: Any
    has_vision: bool
    vision_token_ids: tuple[int, ...] | list[int]


@runtime_checkable
class VisionTextFamily(TextFamily, Protocol):
    """A text family whose prompts carry images (`has_vision` True).

    - `prepare(prompt, images, sample_id) -> (text, pixel_values [N, D] fp32, grids [k, 3] long)`:
      the prompt with each image placeholder expanded into the model's vision tokens; raises
      naming `sample_id` when placeholders and images disagree in number.
    - `positions(input_ids [B, L], attention_mask [B, L], image_grid_thw [sum k, 3] | None)`:
      the forward's rotary `position_ids` (Qwen-VL's [3, B, L] multimodal positions).
    - `vision_inputs(pixel_values per row, grids per row, device) -> dict`: the forward's image
      keyword arguments for a batch, {} when no row has an image.
    """

    def prepare(
        self, prompt: str, images: list[Any], sample_id: str
    ) -> tuple[str, torch.Tensor, torch.Tensor]: ...

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor: ...

    def vision_inputs(
        self, pixel_values: list[torch.Tensor], image_grid_thw: list[torch.Tensor], device: Any
    ) -> dict: ...


TEXT_MEMBERS = ("model", "tokenizer", "has_vision", "vision_token_ids")
VISION_MEMBERS = ("prepare", "positions", "vision_inputs")


def text_family_problems(bundle: Any) -> list[str]:
    """The members of `TextFamily` (and of `VisionTextFamily` when `bundle.has_vision`) that
    `bundle` lacks, each named with the class; [] when it satisfies the contract."""
    name = type(bundle).__name__
    missing = [m for m in TEXT_MEMBERS if not hasattr(bundle, m)]
    if getattr(bundle, "has_vision", False):
        missing += [m for m in VISION_MEMBERS if not callable(getattr(bundle, m, None))]
    return [
        f"{name} lacks `{m}`, which the text stage calls (unirl.models.causal_lm.family."
        f"{'VisionTextFamily' if m in VISION_MEMBERS else 'TextFamily'})"
        for m in missing
    ]


class TextBundle:
    """A transformers causal LM and its tokenizer: the plumbing every text family's bundle shares
    (as `unirl.models.flow.family.DiffusersBundle` is the diffusion families'). A family subclasses
    it, sets `auto_model` (the transformers auto class of its directories) and adds its builders
    (`unirl.models.qwen.QwenBundle.tiny`) or its vision members (`unirl.models.qwen_vl`).

    Attributes:
        model: the `AutoModelForCausalLM` (Qwen3ForCausalLM, Qwen2ForCausalLM, ...).
        tokenizer: its fast tokenizer; `eos_token_id` ends responses, `pad_token_id`
            pads batches (EOS when the tokenizer has no pad token).
        has_vision: False here; a vision-language bundle (`unirl.models.qwen_vl.QwenVLBundle`)
            also takes images with its prompts.
        vision_token_ids: () here: a text-only model has no token a response must not hold.

    A `TextFamily`.
    """

    has_vision: ClassVar[bool] = False
    vision_token_ids: ClassVar[tuple[int, ...]] = ()
    auto_model: ClassVar[type] = AutoModelForCausalLM

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, where: str) -> None:
        rows = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > rows:
            raise ValueError(
                f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                f"{rows} rows; token ids >= {rows} would index past it. Use the tokenizer saved with "
                "this model (or resize the model's embeddings to the tokenizer)"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{where}: the tokenizer has no eos_token; set it in tokenizer_config.json")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> TextBundle:
        """Load a local directory (model and tokenizer files side by side), never the hub."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model.pretrained_path {path!r} is not a directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"model.pretrained_path {path!r} has no config.json: not a Hugging Face model directory"
            )
        model = cls.auto_model.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer, where=f"model.pretrained_path {path!r}")

    @property
    def device(self) -> torch.device:
        return module_device(self.model)

    def to(self, device: str | torch.device) -> TextBundle:
        """Move the model to `device`; returns self."""
        self.model.to(device)
        return self

    def pair_batch(
        self, rows: list[tuple], where: str, max_positions: int | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One right-padded batch of (prompt, completion) rows, or (prompt, completion, images)
        for a vision-language bundle, on the bundle's device: (the forward's keyword arguments,
        labels [B, L] long). Tokens as `encode_pairs` makes them (prompt + completion + EOS,
        labels only at completion and EOS); a VLM's `<image>` placeholders are expanded as
        rollouts expand them (`prepare`, sample ids `<where>/<i>`) and the arguments add
        `pixel_values`, `image_grid_thw` and the rotary `position_ids`. `max_positions` (None:
        the model's) bounds a row. Rows with images for a text-only bundle are an error."""
        if max_positions is None:
            max_positions = self.model.config.get_text_config().max_position_embeddings
        if self.has_vision:
            prepared = [
                self.prepare(r[0], list(r[2]) if len(r) > 2 else [], f"{where}/{i}")
                for i, r in enumerate(rows)
            ]
            pairs = [(text, r[1]) for (text, _, _), r in zip(prepared, rows, strict=True)]
        elif any(len(r) > 2 and r[2] for r in rows):
            raise ValueError(
                f"{where}: the data gives images with its pairs but the model is a text-only causal LM; use "
                "model._target_=unirl.models.qwen_vl.QwenVLConfig"
            )
        else:
            pairs = [(r[0], r[1]) for r in rows]
        input_ids, mask, labels = encode_pairs(self.tokenizer, pairs, max_positions)
        device = self.device
        inputs = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
        if self.has_vision:
            inputs.update(self.vision_inputs([p[1] for p in prepared], [p[2] for p in prepared], device))
            inputs["position_ids"] = self.positions(
                inputs["input_ids"], inputs["attention_mask"], inputs.get("image_grid_thw")
            )
        return inputs, labels.to(device)

    @staticmethod
    def write_weights(path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
        """The train backend's exporter: a LoRA state as a peft adapter directory
        (`adapter_model.safetensors` + `adapter_config.json`, what `PeftModel.from_pretrained`
        and transformers' `load_adapter` read), a full state as a transformers model
        directory (`from_pretrained` reads it)."""
        if kind == "lora":
            from peft.utils import SAFETENSORS_WEIGHTS_NAME
            from safetensors.torch import save_file

            config = module.peft_config["default"]
            config.save_pretrained(path)
            # peft's own names: "base_model.model." + the module path of each adapter weight
            save_file(
                {f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
                os.path.join(path, SAFETENSORS_WEIGHTS_NAME),
                metadata={"format": "pt"},
            )
            return
        cls = next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
        fresh = cls(module.config)
        fresh.load_state_dict(state)
        fresh.save_pretrained(path)

    def save_pretrained(self, path: str) -> None:
        """Write model and tokenizer into `path` (`from_pretrained` reads them back)."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
