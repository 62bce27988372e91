"""The causal-LM bundle: a transformers causal LM (Qwen2 / Qwen3 family) and its tokenizer.

Two ways to build one, same code path afterwards:
- `CausalLMConfig(pretrained_path=<dir>)`: a local Hugging Face directory
  (`config.json`, weights, tokenizer files), read with `local_files_only`.
- `CausalLMConfig(tiny=TinyLMConfig(...))`: a tiny random Qwen3 / Qwen2 built
  from a config, with a byte-level tokenizer built in code (no files, no hub).

`save_pretrained(dir)` writes model and tokenizer so that
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
(or `CausalLMConfig(pretrained_path=dir)`) load them back offline.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from unirl.models.source import (
    DTYPES,
    DType,
    check_source,
    missing_directory_problems,
    read_checkpoint_meta,
)
from unirl.models.stage import module_device
from unirl.types.constraints import AtLeastOne, check_fields

_ARCHITECTURES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
IGNORE_INDEX = -100  # a label position no loss reads (prompt, padding)
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's templates render it (no system prompt is added)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TinyLMConfig:
    """A tiny random causal LM for CPU runs and tests.

    `architecture` is "qwen3" (per-head q/k RMSNorm) or "qwen2" (qkv biases).
    The head dim is `hidden_size // num_attention_heads`; the vocabulary is
    the tiny byte-level tokenizer's (256 bytes + 3 special tokens). Weights
    are drawn under `seed` without touching the global RNG. Embeddings are
    untied by default: a random model with tied ones mostly echoes its last
    input token under greedy decoding, which makes a poor test subject.
    """

    architecture: str = "qwen3"
    hidden_size: AtLeastOne = 64
    num_layers: AtLeastOne = 2
    num_attention_heads: AtLeastOne = 4
    num_key_value_heads: AtLeastOne = 2
    intermediate_size: AtLeastOne = 128
    max_position_embeddings: AtLeastOne = 512
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"model.tiny.architecture must be one of {sorted(_ARCHITECTURES)}, got {self.architecture!r}"
            )
        check_fields(self, "model.tiny.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} must be a multiple of "
                f"model.tiny.num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"model.tiny head dim hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} must be even (rotary embeddings)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.tiny.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.tiny.num_key_value_heads={self.num_key_value_heads}"
            )


@dataclass
class CausalLMConfig:
    """Which causal LM to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local Hugging Face directory of a causal LM and its tokenizer.
        tiny: tiny-model config used when `pretrained_path` is null.
        dtype: parameter dtype of the model ("float32", "bfloat16", "float16").
    """

    modality: ClassVar[str] = "text"

    pretrained_path: str | None = None
    tiny: TinyLMConfig | None = None
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_source(self, TinyLMConfig, "causal-LM", exclusive=True)

    def trainable_on_meta(self) -> torch.nn.Module:
        """The LM's module tree on the meta device (no weights read): for validators
        that check names (FSDP blocks, LoRA targets) before any work starts."""
        return model_on_meta(
            self.pretrained_path,
            AutoModelForCausalLM.from_config,
            lambda: CausalLMBundle.tiny(self.tiny).model,
        )

    def build(self) -> CausalLMBundle:
        if self.pretrained_path is not None:
            return CausalLMBundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return CausalLMBundle.tiny(self.tiny, dtype=DTYPES[self.dtype])

    def load_checkpoint(self, path: str) -> CausalLMBundle:
        """The bundle of a UniRL checkpoint of a causal-LM run, fp32 (`load_checkpoint`)."""
        return load_checkpoint(path)

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory (its files are checked when read)."""
        path = self.pretrained_path
        problems = missing_directory_problems(path, "Hugging Face causal-LM (Qwen3 / Qwen2)")
        if problems or not path:
            return problems
        from unirl.models.causal_lm.vision import is_vlm_directory

        if is_vlm_directory(path):
            return [
                f"model.pretrained_path: {path!r} holds a vision-language model (its config.json has a "
                "vision_config) but model._target_ is unirl.models.causal_lm.CausalLMConfig; use "
                "unirl.models.causal_lm.VLMConfig"
            ]
        return []


def model_on_meta(
    pretrained_path: str | None,
    from_config: Callable[[Any], torch.nn.Module],
    tiny_model: Callable[[], torch.nn.Module],
    config_cls: Any = None,
) -> torch.nn.Module:
    """A text or unified family's `trainable_on_meta`: the model's module tree on the meta device,
    no weights read (validators check FSDP block and LoRA target names against it). With
    `pretrained_path`, `from_config(config)` of its config (read by `config_cls.from_pretrained`,
    transformers' `AutoConfig` when None, local files only) under the meta device; else
    `tiny_model()` (the tiny config's model) under the meta device."""
    if pretrained_path is not None:
        if config_cls is None:
            from transformers import AutoConfig

            config_cls = AutoConfig
        config = config_cls.from_pretrained(pretrained_path, local_files_only=True)
        with torch.device("meta"):
            return from_config(config)
    with torch.device("meta"):
        return tiny_model()


def fast_tokenizer(tok, extra_special: tuple[str, ...] = (), **options) -> PreTrainedTokenizerFast:
    """The `PreTrainedTokenizerFast` over a `tokenizers.Tokenizer` built in code (the tiny
    tokenizers): `SPECIAL_TOKENS` (`<|endoftext|>`, EOS and pad, `<|im_start|>`, `<|im_end|>`) and
    `extra_special` (e.g. a VLM's vision tokens) added to `tok` as special tokens, each one token,
    the ones after EOS as `additional_special_tokens`; no clean-up of tokenization spaces.
    `options` are further `PreTrainedTokenizerFast` arguments (e.g. `chat_template`)."""
    from tokenizers import AddedToken

    special = (*SPECIAL_TOKENS, *extra_special)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(special[1:]),
        clean_up_tokenization_spaces=False,
        **options,
    )


def tiny_tokenizer(extra_special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: every byte is one token (printable ASCII
    characters map to themselves), then `<|endoftext|>` (EOS and pad),
    `<|im_start|>`, `<|im_end|>` and `extra_special` (e.g. a VLM's vision tokens), each
    one token; a ChatML chat template. Decoding gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return fast_tokenizer(tok, extra_special, chat_template=CHAT_TEMPLATE)


class CausalLMBundle:
    """A causal LM and its tokenizer.

    Attributes:
        model: the `AutoModelForCausalLM` (Qwen3ForCausalLM, Qwen2ForCausalLM, ...).
        tokenizer: its fast tokenizer; `eos_token_id` ends responses, `pad_token_id`
            pads batches (EOS when the tokenizer has no pad token).
        has_vision: False here; a vision-language bundle (`vision.VLMBundle`) also takes
            images with its prompts.
        vision_token_ids: () here: a text-only model has no token a response must not hold.

    A `unirl.models.causal_lm.family.TextFamily`.
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
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> CausalLMBundle:
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

    @classmethod
    def tiny(cls, cfg: TinyLMConfig, dtype: torch.dtype = torch.float32) -> CausalLMBundle:
        """A randomly initialized tiny LM, deterministic in `cfg.seed`."""
        tokenizer = tiny_tokenizer()
        config_cls, model_cls = _ARCHITECTURES[cfg.architecture]
        config = config_cls(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = model_cls(config).to(dtype)
        return cls(model, tokenizer, where="model.tiny")

    @property
    def device(self) -> torch.device:
        return module_device(self.model)

    def to(self, device: str | torch.device) -> CausalLMBundle:
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
                "model._target_=unirl.models.causal_lm.VLMConfig"
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


def encode_pairs(
    tokenizer: Any, pairs: list[tuple[str, str]], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize (prompt, completion) pairs into one right-padded batch.

    Row i is prompt_i + completion_i + [EOS] (prompt and completion each through
    `tokenizer(text, add_special_tokens=False)`, as rollouts tokenize prompts).

    Returns (input_ids [B, L] long, padded with the pad id; attention_mask [B, L] long;
    labels [B, L] long: the token at completion and EOS positions, IGNORE_INDEX at prompt
    and padding positions). A row longer than `max_positions` is an error naming it.
    """
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    rows, labels = [], []
    for (prompt, completion), p, c in zip(pairs, prompts, completions, strict=True):
        if not p:
            raise ValueError(f"the prompt of pair {(prompt, completion)!r} is empty (0 tokens)")
        seq = p + c + [tokenizer.eos_token_id]
        if len(seq) > max_positions:
            raise ValueError(
                f"pair {(prompt, completion)!r} is {len(seq)} tokens with EOS, more than the model's "
                f"max_position_embeddings ({max_positions}); shorten the data or enlarge the model"
            )
        rows.append(seq)
        labels.append([IGNORE_INDEX] * len(p) + c + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    target = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        target[i, : len(r)] = torch.tensor(lab)
    return input_ids, mask, target


def load_checkpoint(
    path: str, dtype: torch.dtype = torch.float32, bundle_cls: type[CausalLMBundle] = CausalLMBundle
) -> CausalLMBundle:
    """Load a bundle with the trained weights of a UniRL checkpoint directory.

    Reads `unirl_checkpoint.json` (written by the train backend), loads its
    `base_model` directory, then applies the weights: a LoRA adapter directory
    merged into the base through peft (`PeftModel.from_pretrained(...).merge_and_unload()`),
    or the full model directory itself.
    """
    meta = read_checkpoint_meta(path)
    base = bundle_cls.from_pretrained(meta["base_model"], dtype=dtype)
    if meta["kind"] == "lora":
        from peft import PeftModel

        base.model = PeftModel.from_pretrained(base.model, path, local_files_only=True).merge_and_unload()
        return base
    base.model = bundle_cls.auto_model.from_pretrained(path, dtype=dtype, local_files_only=True)
    return base
