"""Rollout-training mismatch: its metrics and its four corrections, against hand computation.

A rollout engine (vLLM) drew the tokens from pi_rollout; the trainer's replay gives pi_old. The
weights are checked element by element on a small hand-written case, then inside GRPO's loss: the
corrected loss equals the uncorrected per-token loss times the hand weights, aggregated the same
way. The bigram stage and the 4-sample track are test_grpo_family's.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.test_grpo_family import BigramStage, make_track
from unirl.algorithms.grpo import GRPO, GRPOConfig
from unirl.algorithms.token_losses import correction_weights, mismatch_metrics

# two samples: 3 tokens and 1 token (then padding); log pi_old - log pi_rollout per token:
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-1.6, 9.0, 9.0]])  # padding values must not matter
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
# rho_t = exp(OLD - ROLLOUT) on the valid tokens: e^0.5, e^-1, 1 | e^1.3


def test_token_weights_by_hand() -> None:
    e = math.exp
    truncate = correction_weights(OLD, ROLLOUT, MASK, "token_truncate", 1.5)
    assert torch.allclose(truncate, torch.tensor([[min(e(0.5), 1.5), e(-1), 1.0], [1.5, 0, 0]]))
    masked = correction_weights(OLD, ROLLOUT, MASK, "token_mask", 1.5)
    assert torch.allclose(masked, torch.tensor([[0.0, e(-1), 1.0], [0.0, 0, 0]]))  # e^0.5 = 1.65 > 1.5


def test_sequence_weights_by_hand() -> None:
    e = math.exp
    # sequence log-ratios: 0.5 - 1 + 0 = -0.5 and 1.3
    truncate = correction_weights(OLD, ROLLOUT, MASK, "sequence_truncate", 2.0)
    assert torch.allclose(truncate, torch.tensor([[e(-0.5)] * 3, [2.0, 0, 0]]))
    masked = correction_weights(OLD, ROLLOUT, MASK, "sequence_mask", 4.0)
    assert torch.allclose(masked, torch.tensor([[e(-0.5)] * 3, [e(1.3), 0, 0]]))
    masked = correction_weights(OLD, ROLLOUT, MASK, "sequence_mask", 3.0)  # e^1.3 = 3.67 > 3
    assert torch.allclose(masked, torch.tensor([[e(-0.5)] * 3, [0.0, 0, 0]]))


def test_mismatch_metrics_by_hand() -> None:
    m = mismatch_metrics(OLD, ROLLOUT, MASK)
    assert m["mismatch/abs_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.3) / 4)
    assert m["mismatch/abs_diff_max"] == pytest.approx(1.3)
    # per sample sum of log pi_rollout - log pi_old: (-0.5 + 1 + 0) and -1.3
    assert m["mismatch/seq_kl"] == pytest.approx((0.5 - 1.3) / 2)


def test_on_policy_weights_are_one() -> None:
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert torch.equal(correction_weights(OLD, OLD, MASK, mode, 1.0), MASK)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_grpo_loss_is_weighted_by_the_correction(mode) -> None:
    """pi_old replayed (the stage's own log-probs), the engine's log-probs shifted off it: the
    corrected loss is sum(w * L_t) / tokens with L_t the uncorrected per-token loss and w the hand
    weights; the mismatch metrics measure the shift; the first ratio is still exactly 1."""
    stage = BigramStage()
    shifted = make_track(stage, shift=[0.8, -0.6, 0.3, -1.2])
    plain = GRPO(GRPOConfig(old_logp_source="replay"))
    corrected = GRPO(
        GRPOConfig(old_logp_source="replay", rollout_correction=mode, rollout_correction_cap=1.5)
    )
    prepared = corrected.prepare_segment(stage, shifted)
    seg = prepared.segment
    assert all(
        torch.equal(a, b) for a, b in zip(seg.rollout_log_probs, shifted.segment.log_probs, strict=True)
    )
    old, behaviour, mask = seg.padded("log_probs"), seg.padded("rollout_log_probs"), seg.response_mask()
    ctx = {"loss_scale": 1.0}
    stage.module.zero_grad()
    out = corrected.compute_loss_and_backward(stage, prepared, ctx)
    grad = stage.module.table.grad.clone()

    # by hand: GRPO's per-token loss at ratio 1 is -A; the weights from the log-ratio old - behaviour
    adv = torch.tensor([1.5, -1.5, -0.5, 0.5])[:, None].expand_as(mask)
    rho = torch.exp((old - behaviour) * mask)
    if mode.startswith("sequence"):
        rho = torch.exp(((old - behaviour) * mask).sum(1, keepdim=True)).expand_as(mask)
    w = rho.clamp(max=1.5) if mode.endswith("truncate") else torch.where(rho <= 1.5, rho, 0.0)
    assert out["loss"] == pytest.approx(float((-adv * w * mask).sum() / mask.sum()), rel=1e-6)
    assert out["ratio/mean"] == 1.0 and out["mismatch/abs_diff_max"] == pytest.approx(1.2)
    assert out["rollout_is/weight_mean"] == pytest.approx(float((w * mask).sum() / mask.sum()), rel=1e-6)

    # the gradient is the weighted one: differs from the uncorrected loss's
    stage.module.zero_grad()
    plain.compute_loss_and_backward(stage, plain.prepare_segment(stage, shifted), ctx)
    assert not torch.allclose(grad, stage.module.table.grad)


def test_config_errors_name_the_keys() -> None:
    with pytest.raises(ValueError, match=r"rollout_correction must be one of \[.*\] or null, got 'tis'"):
        GRPOConfig(old_logp_source="replay", rollout_correction="tis")
    with pytest.raises(ValueError, match="set algorithm.config.old_logp_source=replay"):
        GRPOConfig(old_logp_source="rollout", rollout_correction="token_truncate")
    with pytest.raises(ValueError, match="rollout_correction_cap must be >= 1"):
        GRPOConfig(old_logp_source="replay", rollout_correction="token_mask", rollout_correction_cap=0.5)
