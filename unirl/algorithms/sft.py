"""Supervised fine-tuning of a causal LM as a track's loss (the demonstrations' cross-entropy).

The batch comes from a `unirl.rollout.demonstrations.DemonstrationEngine`: each sample's response
is the demonstration its prompt row carries, teacher-forced. With log p_t the response token's
log-probability at temperature 1 (`stage.token_log_probs`) and m_t its mask,

    L = - sum_{i,t} m_t log p_t / N,   N = the response tokens (EOS included) of the whole batch,

the completion cross-entropy `unirl.train.lm_sft.completion_loss` computes for the same pairs.
Each micro-batch contributes its share (`aggregate(..., "token-mean", num_tokens)` with the
batch's totals from the train stack), so micro-batching and data parallelism give the batch's loss
exactly. No reward or advantage enters it (`uses_reward = False`); the run then has neither.
"""

from __future__ import annotations

from typing import Any, ClassVar

from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.grpo import text_segment
from unirl.algorithms.token_losses import aggregate
from unirl.models.stage import TextStage
from unirl.types.rollout_resp import RolloutTrack


class LMSFT(StageAlgorithm):
    """Token-mean cross-entropy of a text track's demonstrations (see the module docstring).

    `compute_loss_and_backward` reads `loss_scale` and `num_tokens` (the batch's response tokens
    over the world size) from ctx; its `loss` metric is the batch's mean token cross-entropy.
    """

    modality: ClassVar[str] = "text"
    supports_multi_update: ClassVar[bool] = True
    uses_reward: ClassVar[bool] = False
    learns_from_demonstrations: ClassVar[bool] = True

    def compute_loss_and_backward(
        self, stage: TextStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        seg = text_segment(track)
        logp = stage.token_log_probs(seg).float()
        mask = seg.response_mask().to(device=logp.device, dtype=logp.dtype)
        loss = aggregate(-logp, mask, "token-mean", num_tokens=ctx["num_tokens"])
        loss.backward()
        scale = ctx["loss_scale"]  # the stack averages rows over micro-batches: report the batch's share
        return {
            "loss": float(loss.detach()) / scale,
            "response_length/mean": float(mask.sum(dim=1).mean()),
        }
