"""Supervised training of a causal LM on (prompt, completion) pairs (pretraining / the SFT stage).

Loss: token cross-entropy of the completion followed by the tokenizer's EOS, given the
prompt; prompt and padding positions are masked out, and the mean is over the batch's
completion (+ EOS) tokens. A prompt is tokenized exactly as `CausalLMStage.encode_prompts`
does with `chat_template: false` (`tokenizer(text, add_special_tokens=False)`) and the
completion separately after it, so a supervised model and the RL rollouts that start from
it see the same token sequences, and a sampled response ends at the EOS it was taught.
The run is resumable from its `sft_state.pt`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from unirl.models.causal_lm.family import TextBundle
from unirl.models.causal_lm.loading import IGNORE_INDEX, encode_pairs  # noqa: F401 (re-exported)
from unirl.train.backend import LRSchedule
from unirl.train.supervised import SupervisedConfig, SupervisedRun
from unirl.types.constraints import AtLeastOne, NonNegativeInt


@dataclass
class CausalLMSFTConfig(SupervisedConfig):
    """Settings of a supervised causal-LM run: `SupervisedConfig` with batch_size the
    (prompt, completion) pairs per step."""

    num_steps: AtLeastOne = 2000
    batch_size: AtLeastOne = 64
    warmup_steps: NonNegativeInt = 100
    lr_schedule: LRSchedule = "cosine"
    eval_every: NonNegativeInt = 500


class TextPairSource(Protocol):
    """Supervised text: `sample_batch(n, rng) -> [(prompt, completion)] * n`, or for a
    vision-language model `[(prompt, completion, images)] * n` (the prompt's `<image>`
    placeholders, one per image, as in RL rows)."""

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple]: ...


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 mean cross-entropy of `labels[:, 1:]` under `logits[:, :-1]` ([B, L, V]) over the
    positions whose label is not IGNORE_INDEX (position t predicts token t + 1)."""
    pred = logits[:, :-1].float()
    return F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


class CausalLMSFT(SupervisedRun):
    """Trains `bundle.model` on `data` with `completion_loss` (full fine-tune, AdamW),
    through the shared resumable loop (`unirl.train.supervised.SupervisedRun`).

    Args:
        bundle: the causal LM and its tokenizer, on the device to train on.
        data: the supervised (prompt, completion) source, drawn from a seeded numpy generator.
        cfg: run settings.
        output_dir: where `sft_state.pt` (resumable) and `metrics.jsonl` go.
        evaluator: optional `evaluator(bundle) -> dict[str, float]` run every `eval_every`
            steps and at the end (e.g. `LMEvaluator`); its numbers go into the log as `eval/<key>`.
    """

    log_name = "metrics.jsonl"

    def __init__(
        self,
        bundle: TextBundle,
        data: TextPairSource,
        cfg: CausalLMSFTConfig,
        output_dir: str,
        evaluator: Callable[[TextBundle], dict[str, float]] | None = None,
    ) -> None:
        if not isinstance(bundle, TextBundle):
            raise TypeError(
                f"CausalLMSFT trains a causal LM (model: unirl.models.qwen.QwenConfig), "
                f"got {type(bundle).__name__}"
            )
        self.bundle, self.data, self.model = bundle, data, bundle.model
        self.max_positions: int = self.model.config.get_text_config().max_position_embeddings
        super().__init__([self.model], cfg, output_dir, evaluator, bundle)

    def batch_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """The completion loss of a fresh batch, and its non-padding token count (`tokens`)."""
        rows = self.data.sample_batch(self.cfg.batch_size, self.rng)
        inputs, labels = self.bundle.pair_batch(rows, "sft", self.max_positions)
        logits = self.model(**inputs).logits
        return completion_loss(logits, labels), {"tokens": float(inputs["attention_mask"].sum())}

    def export(self, path: str, dtype: torch.dtype = torch.float16) -> None:
        """Write model (weights in `dtype`) and tokenizer to `path`, a directory that
        `QwenConfig(pretrained_path=path)` loads; the in-memory model keeps its dtype."""
        trained = next(self.model.parameters()).dtype
        self.model.to(dtype)
        try:
            self.bundle.save_pretrained(path)
        finally:
            self.model.to(trained)
