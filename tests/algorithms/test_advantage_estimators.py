"""RLOO, REINFORCE++ (and its baseline variant), Dr.GRPO's centring and KL folded into the reward,
checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.advantages import compute_advantages, track_advantages
from unirl.types import AdvantageConfig, LatentSegment, RolloutTrack, TokenSegment

EPS = 1e-4


def close(actual: torch.Tensor, expected: list, tol: float = 1e-6) -> None:
    assert actual.dtype == torch.float32
    assert list(actual.shape) == list(torch.tensor(expected).shape)
    flat = torch.tensor(expected, dtype=torch.float64).flatten().tolist()
    assert actual.flatten().tolist() == pytest.approx(flat, rel=tol, abs=tol)


def test_rloo_leave_one_out() -> None:
    rewards = torch.tensor([1.0, 2.0, 6.0, 0.7, 0.7, 0.7])
    adv = compute_advantages(rewards, ["a"] * 3 + ["b"] * 3, AdvantageConfig(estimator="rloo"))
    # A_i = r_i - mean of the two siblings
    close(adv[:3], [1 - (2 + 6) / 2, 2 - (1 + 6) / 2, 6 - (1 + 2) / 2])  # -3, -1.5, 4.5
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # an equal group: exactly 0


def test_rloo_needs_siblings() -> None:
    with pytest.raises(ValueError, match=r"estimator=rloo .* groups of >= 2 samples .*samples_per_prompt"):
        compute_advantages(torch.tensor([1.0, 2.0]), ["a", "b"], AdvantageConfig(estimator="rloo"))


def test_grpo_without_std_is_dr_grpo() -> None:
    adv = compute_advantages(
        torch.tensor([1.0, 2.0, 6.0, 0.7, 0.7, 0.7]),
        ["a"] * 3 + ["b"] * 3,
        AdvantageConfig(norm_by_std=False),
    )
    close(adv, [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0])
    assert adv[3:].tolist() == [0.0] * 3
    flat = compute_advantages(
        torch.tensor([1.0, 2.0, 6.0]), ["x", "y", "z"], AdvantageConfig(scope="global", norm_by_std=False)
    )
    close(flat, [-2.0, -1.0, 3.0])


def test_kl_folded_into_the_sequence_reward() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token_kl = torch.tensor([[0.5, 0.25], [1.0, 9.0]])  # 9.0 sits on padding: ignored
    cfg = AdvantageConfig(kl_coef=0.1, kl_estimator="k1")
    adv = compute_advantages(torch.tensor([1.0, 2.0]), ["g", "g"], cfg, mask=mask, token_kl=token_kl)
    # r' = [1 - 0.1 * 0.75, 2 - 0.1 * 1.0] = [0.925, 1.9]; mean 1.4125, std 0.4875
    a = 0.4875 / (0.4875 + EPS)
    close(adv, [-a, a])
    rloo = compute_advantages(
        torch.tensor([1.0, 2.0]),
        ["g", "g"],
        AdvantageConfig(estimator="rloo", kl_coef=0.1),
        mask=mask,
        token_kl=token_kl,
    )
    close(rloo, [0.925 - 1.9, 1.9 - 0.925])


def whiten(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def test_reinforce_pp_discounted_returns_whitened() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = AdvantageConfig(estimator="reinforce_pp", gamma=0.5)
    adv = compute_advantages(torch.tensor([1.0, 0.0]), ["a", "b"], cfg, mask=mask)
    # sample 0: reward 1 at its last token, returns [0.25, 0.5, 1]; sample 1: [0, 0]
    returns = [0.25, 0.5, 1.0, 0.0, 0.0]
    m, s = whiten(returns)
    assert (m, s) == pytest.approx((0.35, math.sqrt(0.14)))
    z = [(g - m) / (s + EPS) for g in returns]
    close(adv, [[z[0], z[1], z[2]], [z[3], z[4], 0.0]], tol=1e-5)


def test_reinforce_pp_with_token_kl() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_kl = torch.tensor([[0.2, 0.0, 0.4], [1.0, 0.5, 7.0]])
    cfg = AdvantageConfig(estimator="reinforce_pp", kl_coef=0.1)
    adv = compute_advantages(torch.tensor([1.0, 0.5]), ["a", "b"], cfg, mask=mask, token_kl=token_kl)
    # token rewards: [-0.02, 0, -0.04 + 1] and [-0.1, -0.05 + 0.5]; gamma 1 returns sum the rest
    returns = [-0.02 + 0 + 0.96, 0 + 0.96, 0.96, -0.1 + 0.45, 0.45]
    m, s = whiten(returns)
    z = [(g - m) / (s + EPS) for g in returns]
    close(adv, [[z[0], z[1], z[2]], [z[3], z[4], 0.0]], tol=1e-5)


def test_reinforce_pp_baseline_group_centred_then_scaled() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = AdvantageConfig(estimator="reinforce_pp_baseline")
    adv = compute_advantages(torch.tensor([1.0, 3.0, 0.7, 0.7]), ["a", "a", "b", "b"], cfg, mask=mask)
    # centred per group: [-1, 1, 0, 0], broadcast: tokens [-1, -1 | 1 | 0, 0, 0 | 0, 0]
    tokens = [-1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    _, s = whiten(tokens)
    assert s == pytest.approx(math.sqrt(23) / 8)
    k = 1 / (s + EPS)
    close(adv, [[-k, -k, 0.0], [k, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert adv[2:].abs().sum().item() == 0.0  # the equal group keeps exactly 0


@pytest.mark.parametrize("value", [0.7, 21.0 + 1 / 7, 0.2 * 0.3 + 0.7 * 0.9])
def test_equal_rewards_give_exactly_zero_in_every_estimator(value: float) -> None:
    n = 4
    rewards = torch.tensor([value] * n + [0.0, 1.0, 2.0, 5.0])
    groups = ["same"] * n + ["varied"] * n
    mask = torch.tensor([[1.0] * (1 + i % 3) + [0.0] * (2 - i % 3) for i in range(2 * n)])
    for estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
        for cfg in (AdvantageConfig(estimator=estimator), AdvantageConfig(estimator=estimator, clip=5.0)):
            adv = compute_advantages(rewards, groups, cfg, mask=mask)
            assert adv[:n].abs().sum().item() == 0.0, (estimator, value)
            assert adv[n:].abs().max() > 0
    dr = compute_advantages(rewards, groups, AdvantageConfig(norm_by_std=False))
    assert dr[:n].tolist() == [0.0] * n
    # REINFORCE++ has no groups: its baseline is the batch, so an all-equal batch gives exactly 0
    flat = compute_advantages(
        rewards[:n], groups[:n], AdvantageConfig(estimator="reinforce_pp"), mask=mask[:n]
    )
    assert flat.abs().sum().item() == 0.0


def test_token_estimators_need_the_mask() -> None:
    with pytest.raises(ValueError, match=r"estimator='reinforce_pp' .* needs the \[B, Rmax\] response mask"):
        compute_advantages(torch.tensor([1.0]), ["a"], AdvantageConfig(estimator="reinforce_pp"))
    with pytest.raises(ValueError, match=r"kl_coef=0.1 folds the KL into the reward: pass token_kl"):
        compute_advantages(
            torch.tensor([1.0, 2.0]), ["a", "a"], AdvantageConfig(kl_coef=0.1), mask=torch.ones(2, 1)
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"estimator": "ppo"}, "advantage.estimator must be one of"),
        ({"kl_estimator": "k4"}, "advantage.kl_estimator must be one of"),
        ({"gamma": 0.0, "estimator": "reinforce_pp"}, r"advantage.gamma must be in \(0, 1\]"),
        ({"gamma": 1.5, "estimator": "reinforce_pp"}, r"advantage.gamma must be in \(0, 1\]"),
        ({"gamma": 0.9}, "advantage.gamma discounts reinforce_pp's token returns"),
        ({"kl_coef": -0.1}, "advantage.kl_coef must be >= 0"),
        ({"estimator": "rloo", "scope": "global"}, "advantage.scope and advantage.global_std apply to"),
        ({"estimator": "reinforce_pp", "global_std": True}, "advantage.scope and advantage.global_std"),
        ({"global_std": True, "norm_by_std": False}, "advantage.global_std divides by the batch std"),
    ],
)
def test_config_errors_name_the_key(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdvantageConfig(**kwargs)


def token_track(ref: bool) -> RolloutTrack:
    seg = TokenSegment(
        prompt_ids=[torch.tensor([1, 2]), torch.tensor([3])],
        response_ids=[torch.tensor([4, 5]), torch.tensor([6])],
        log_probs=[torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
        ref_log_probs=[torch.tensor([-1.5, -1.0]), torch.tensor([-0.25])] if ref else None,
    )
    return RolloutTrack(
        name="ar",
        sample_ids=["0", "1"],
        group_ids=["g", "g"],
        prompts=["p", "p"],
        metadata=[{}, {}],
        segment=seg,
        rewards=torch.tensor([1.0, 2.0]),
    )


def test_track_folds_the_kl_from_its_segment() -> None:
    track = token_track(ref=True)
    adv = track_advantages(track, AdvantageConfig(estimator="rloo", kl_coef=0.2, kl_estimator="k1"))
    # k1 = logp - ref: sample 0 [0.5, -1.0] sums to -0.5, sample 1 [-0.25]
    r = [1.0 - 0.2 * -0.5, 2.0 - 0.2 * -0.25]  # [1.1, 2.05]
    close(adv, [r[0] - r[1], r[1] - r[0]])
    assert adv is track.advantages
    per_token = track_advantages(track, AdvantageConfig(estimator="reinforce_pp_baseline"))
    assert per_token.shape == (2, 2) and per_token[1, 1].item() == 0.0


def test_track_without_reference_log_probs_raises() -> None:
    with pytest.raises(ValueError, match="track 'ar' has no ref_log_probs"):
        track_advantages(token_track(ref=False), AdvantageConfig(kl_coef=0.1))


def test_latent_track_refuses_token_estimators() -> None:
    seg = LatentSegment(
        latents=torch.zeros(2, 1, 1, 1, 1),
        positions=[1],
        sigmas=torch.tensor([1.0, 0.0]),
        sde_indices=[],
        log_probs=torch.zeros(2, 0),
        eta=0.0,
        guidance_scale=1.0,
    )
    track = RolloutTrack("diffusion", ["0", "1"], ["g", "g"], ["", ""], [{}, {}], seg, rewards=torch.ones(2))
    with pytest.raises(ValueError, match="track 'diffusion' holds a LatentSegment"):
        track_advantages(track, AdvantageConfig(estimator="reinforce_pp"))
