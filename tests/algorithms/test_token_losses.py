"""The shared text-loss tensor functions against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.token_losses import (
    aggregate,
    clipped_token_loss,
    kl_penalty,
    log_ratio,
    ratio,
    token_advantages,
)

# two responses: 3 tokens and 2 tokens (the padded slot holds 100 to show it is ignored)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),  # 3.0
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),  # (2 + 4.5) / 2 = 3.25
        ("seq-mean-token-sum", ((1 + 2 + 3) + (4 + 5)) / 2),  # 7.5
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + (4 + 5) / 4) / 2),  # C = 4: 1.875
    ],
)
def test_aggregate_modes_on_the_batch_itself(mode: str, expected: float) -> None:
    got = aggregate(LOSS, MASK, mode, norm_constant=4.0)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 15 / 10),  # 10 tokens in the whole batch
        ("seq-mean-token-mean", (2 + 4.5) / 4),  # 4 samples in the whole batch
        ("seq-mean-token-sum", (6 + 9) / 4),
        ("seq-mean-token-sum-norm", (6 / 4 + 9 / 4) / 4),
    ],
)
def test_aggregate_with_batch_totals_gives_the_share(mode: str, expected: float) -> None:
    got = aggregate(LOSS, MASK, mode, num_tokens=10.0, num_samples=4.0, norm_constant=4.0)
    assert got.item() == pytest.approx(expected)


def test_aggregate_errors() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="needs norm_constant"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


R = torch.tensor([0.5, 0.9, 1.1, 1.25, 1.4, 5.0])


def test_clipped_loss_positive_advantage_clip_higher() -> None:
    loss, clipped, dual = clipped_token_loss(R, torch.tensor(1.0), eps_low=0.2, eps_high=0.28)
    # A > 0: L = -min(r, clip(r, 0.8, 1.28)); only ratios above 1.28 are clipped
    assert loss.tolist() == pytest.approx([-0.5, -0.9, -1.1, -1.25, -1.28, -1.28])
    assert clipped.tolist() == [False, False, False, False, True, True]
    assert not dual.any()  # dual clip only acts on A < 0
    # the symmetric clip (eps_high 0.2) already caps r = 1.25 at 1.2: the asymmetry matters
    sym, sym_clipped, _ = clipped_token_loss(R, torch.tensor(1.0), eps_low=0.2, eps_high=0.2)
    assert sym[3].item() == pytest.approx(-1.2) and sym_clipped[3]


def test_clipped_loss_negative_advantage_and_dual_clip() -> None:
    adv = torch.tensor(-2.0)
    loss, clipped, dual = clipped_token_loss(R, adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    # A = -2: L = 2 max(r, clip(r)); r = 0.5 is lifted to the lower bound 0.8;
    # r = 5 would give 10, the dual clip caps it at -A c = 6
    assert loss.tolist() == pytest.approx([1.6, 1.8, 2.2, 2.5, 2.8, 6.0])
    assert clipped.tolist() == [True, False, False, False, False, False]
    assert dual.tolist() == [False, False, False, False, False, True]
    no_dual, _, dual_off = clipped_token_loss(R, adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=None)
    assert no_dual[5].item() == pytest.approx(10.0) and not dual_off.any()


def test_clipped_loss_gradient_is_zero_where_clipped() -> None:
    r = torch.tensor([1.1, 1.4], requires_grad=True)
    loss, _, _ = clipped_token_loss(r, torch.tensor(1.0), 0.2, 0.28)
    loss.sum().backward()
    assert r.grad.tolist() == [-1.0, 0.0]


def test_ratio_clamps_the_log_ratio() -> None:
    logp = torch.tensor([-1.0, 0.0, -50.0])
    old = torch.tensor([-1.5, -40.0, 0.0])
    assert log_ratio(logp, old).tolist() == [0.5, 20.0, -20.0]
    assert ratio(logp, old).tolist() == pytest.approx([math.exp(0.5), math.exp(20.0), math.exp(-20.0)])


def test_kl_estimators_by_hand() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # d = logp - ref = [0.5, -1.0]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    # k3 = exp(ref - logp) - (ref - logp) - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert k3 == pytest.approx([0.10653065971263342, 0.7182818284590451])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3)
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), kl_penalty(logp, ref, "k3"))


def test_low_var_kl_clamps() -> None:
    logp = torch.tensor([0.0, -1000.0], requires_grad=True)
    ref = torch.tensor([-30.0, 0.0])
    kl = kl_penalty(logp, ref, "low_var_kl")
    # exp(-20) + 20 - 1 ~ 19 and exp(20) - 20 - 1: both capped at 10, finite, and flat there
    assert kl.tolist() == [10.0, 10.0]
    kl.sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_kl_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_token_advantages_broadcast_and_cut() -> None:
    per_sample = token_advantages(torch.tensor([2.0, -1.0]), MASK)
    assert per_sample.tolist() == [[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]]
    wide = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
    assert token_advantages(wide, MASK).tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, >= Rmax\]"):
        token_advantages(torch.zeros(2, 2), MASK)
