"""The Qwen family's value model (PPO's critic): the policy's architecture with a scalar head.

`QwenValueConfig` takes the keys of `QwenConfig` (point them at the policy's:
`pretrained_path: ${model.pretrained_path}`, `tiny: ${model.tiny}`) and builds the critic of
`unirl.models.causal_lm.value` from that policy: the backbone starts from the policy's weights
(the local directory, or the tiny model of the same seed), the head is drawn under `head_seed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from unirl.models.causal_lm.value import CausalLMValueStage, value_config, value_model
from unirl.models.qwen.bundle import QwenBundle
from unirl.models.qwen.config import QwenConfig
from unirl.models.stage import autocast_dtype_of


@dataclass
class QwenValueConfig(QwenConfig):
    """The critic's network (see the module docstring).

    Attributes (beyond `QwenConfig`'s):
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
                config = QwenBundle.tiny(self.tiny).model.config
        with torch.device("meta"):
            return AutoModelForTokenClassification.from_config(value_config(config))

    def build_value_stage(self, policy: object = None) -> CausalLMValueStage:
        """The critic (backbone and head in `dtype`), on the CPU. `policy` (the policy's stage)
        is not read: this config names the architecture and weights itself."""
        policy = self.build()
        model = value_model(policy.model, self.head_seed)
        return CausalLMValueStage(model, policy.tokenizer.pad_token_id, self.autocast_dtype)
