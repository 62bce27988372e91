"""The text families' value model (PPO's critic): the policy's architecture with a scalar head.

`value_model(policy, head_seed)` builds the transformers token-classification model of the
policy's architecture with one label (`Qwen3ForTokenClassification`: the decoder backbone +
`score`, Linear(hidden, 1); verl's critic is the same `AutoModelForTokenClassification`,
num_labels 1), its backbone starting from the policy's weights and its head drawn under
`head_seed`. Dropout before the head is 0, so a sample's values do not depend on train / eval
mode. A family's value config (`unirl.models.qwen.QwenValueConfig`) names the policy.

`CausalLMValueStage.token_values(segment)` is the critic's forward: [B, Rmax] fp32, V_t the
value of the state before response token t (the position whose logits score token t in
`CausalLMStage.token_log_probs`), 0 on padding.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from unirl.models.stage import AUTOCAST_DTYPES, ModuleOwner
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment, pad_right


def value_config(config):
    """A copy of a causal-LM config for a one-label token-classification model without dropout."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def value_model(policy: PreTrainedModel, head_seed: int) -> PreTrainedModel:
    """The one-label token-classification model of `policy`'s architecture and dtype, its backbone
    a copy of the policy's weights, its head drawn under `head_seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(head_seed)
        model = AutoModelForTokenClassification.from_config(value_config(policy.config))
    backbone = policy.base_model_prefix
    getattr(model, backbone).load_state_dict(getattr(policy, backbone).state_dict())
    return model.to(policy.dtype)


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
