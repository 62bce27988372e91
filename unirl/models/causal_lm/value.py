"""The causal-LM family's value model (PPO's critic): the policy's architecture with a scalar head.

`CausalLMValueConfig` takes the keys of `CausalLMConfig` (point them at the policy's:
`pretrained_path: ${model.pretrained_path}`, `tiny: ${model.tiny}`) and builds the
transformers token-classification model of that architecture with one label
(`Qwen3ForTokenClassification`: the decoder backbone + `score`, Linear(hidden, 1); verl's
critic is the same `AutoModelForTokenClassification`, num_labels 1). The backbone starts
from the policy's weights (the local directory, or the tiny model of the same seed); the
head is drawn under `head_seed`. Dropout before the head is 0, so a sample's values do not
depend on train / eval mode.

`CausalLMValueStage.token_values(segment)` is the critic's forward: [B, Rmax] fp32, V_t the
value of the state before response token t (the position whose logits score token t in
`CausalLMStage.token_log_probs`), 0 on padding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from unirl.models.causal_lm.bundle import CausalLMBundle, CausalLMConfig
from unirl.models.source import DTYPES
from unirl.models.stage import AUTOCAST_DTYPES, ModuleOwner, autocast_dtype_of
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment, pad_right


def _value_config(config):
    """A copy of a causal-LM config for a one-label token-classification model without dropout."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


@dataclass
class CausalLMValueConfig(CausalLMConfig):
    """The critic's network (see the module docstring).

    Attributes (beyond `CausalLMConfig`'s):
        autocast_dtype: run the critic's forward under `torch.autocast` in this dtype
            ("bfloat16", "float16"; None: the parameters' dtype); values are fp32.
        head_seed: seed of the value head's initial weights.
    """

    autocast_dtype: str | None = None
    head_seed: int = 0

    head_name: ClassVar[str] = "score"  # the head's module name (trained whole under LoRA)
    modality: ClassVar[str] = "text"  # the tracks it values (checked by the validator)

    def __post_init__(self) -> None:
        super().__post_init__()
        autocast_dtype_of(self.autocast_dtype, "critic.model.autocast_dtype")

    def trainable_on_meta(self) -> torch.nn.Module:
        """The critic's module tree on the meta device (validators read its names)."""
        if self.pretrained_path is not None:
            config = AutoConfig.from_pretrained(self.pretrained_path, local_files_only=True)
        else:
            with torch.device("meta"):
                config = CausalLMBundle.tiny(self.tiny).model.config
        with torch.device("meta"):
            return AutoModelForTokenClassification.from_config(_value_config(config))

    def build_value_stage(self, policy: object = None) -> CausalLMValueStage:
        """The critic (backbone and head in `dtype`), on the CPU. `policy` (the policy's stage)
        is not read: this config names the architecture and weights itself."""
        dtype = DTYPES[self.dtype]
        if self.pretrained_path is not None:
            policy = CausalLMBundle.from_pretrained(self.pretrained_path, dtype=dtype)
        else:
            policy = CausalLMBundle.tiny(self.tiny, dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.head_seed)
            model = AutoModelForTokenClassification.from_config(_value_config(policy.model.config))
        backbone = policy.model.base_model_prefix
        getattr(model, backbone).load_state_dict(getattr(policy.model, backbone).state_dict())
        return CausalLMValueStage(model.to(dtype), policy.tokenizer.pad_token_id, self.autocast_dtype)


class CausalLMValueStage(ModuleOwner):
    """The critic's forward. `module` is what is called; the train backend replaces it with its
    wrapped (LoRA / FSDP) module."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, autocast_dtype: str | None = None) -> None:
        self.module: torch.nn.Module = model
        self.pad_token_id = pad_token_id
        self.autocast_dtype = AUTOCAST_DTYPES[autocast_dtype]

    def values(self, track: RolloutTrack) -> torch.Tensor:
        """`token_values` of the track's `TokenSegment` (the value stages' common call)."""
        if not isinstance(track.segment, TokenSegment):
            raise ValueError(
                f"track {track.name!r} holds a {type(track.segment).__name__}; this critic values text"
            )
        return self.token_values(track.segment)

    def token_values(self, segment: TokenSegment) -> torch.Tensor:
        """[B, Rmax] fp32 values of the response tokens' states, right-padded with 0 (mask:
        `segment.response_mask()`). One forward over prompt_i + response_i per row,
        right-padded (attention mask, positions 0..L_i-1), so a row's values do not depend on
        its batch-mates; position P_i - 1 + t gives V_t. Differentiable."""
        device = self.device
        seqs = [
            torch.cat([p, r]).to(device)
            for p, r in zip(segment.prompt_ids, segment.response_ids, strict=True)
        ]
        input_ids = pad_right(seqs, self.pad_token_id)
        mask = pad_right([torch.ones_like(s) for s in seqs], 0)
        b, width = input_ids.shape
        with torch.autocast(device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.module(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=torch.arange(width, device=device).expand(b, width),
                use_cache=False,
            )
        scores = out.logits[..., 0].float()  # [B, L]
        r_max = max(int(r.numel()) for r in segment.response_ids)
        offsets = (segment.prompt_lengths.to(device) - 1)[:, None] + torch.arange(r_max, device=device)
        values = scores.gather(1, offsets.clamp_(max=width - 1))
        return torch.where(segment.response_mask().to(device).bool(), values, 0.0)
