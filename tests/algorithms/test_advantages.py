"""Reward -> advantage shaping checked against plain-Python hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.algorithms.advantages import compute_advantages, group_layout, track_advantages
from unirl.types import AdvantageConfig, LatentSegment, RolloutTrack

EPS = 1e-4


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def pop_std(xs: list[float]) -> float:
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert actual.dtype == torch.float32
    got = actual.tolist()
    assert len(got) == len(expected)
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert a == pytest.approx(e, rel=tol, abs=tol), f"index {i}: {a} != {e}"


# two groups of three siblings
REWARDS = [1.0, 2.0, 3.0, 0.5, 0.5, 3.5]
GROUPS = ["a", "a", "a", "b", "b", "b"]


def test_group_zscore_concrete_numbers() -> None:
    adv = compute_advantages(torch.tensor(REWARDS), GROUPS, AdvantageConfig())
    # group a: mean 2, population std sqrt(2/3) = 0.81650, A = +-1 / (0.81650 + 1e-4)
    # group b: mean 1.5, population std sqrt(2) = 1.41421, A = (-1, -1, 2) / (1.41421 + 1e-4)
    a = 1.0 / (math.sqrt(2.0 / 3.0) + EPS)
    b = 1.0 / (math.sqrt(2.0) + EPS)
    assert a == pytest.approx(1.2245948897605123)
    close(adv, [-a, 0.0, a, -b, -b, 2 * b])


def test_group_zscore_matches_hand_computation_on_four_groups() -> None:
    rewards = [0.3, -1.2, 4.0, 0.0, 7.5, 7.5, 7.0, 9.0, -2.0, -2.5, 1.0, 0.25, 3.0, 3.0, 3.0, 3.0]
    groups = [f"g{i // 4}" for i in range(16)]
    expected: list[float] = []
    for g in range(4):
        chunk = rewards[4 * g : 4 * g + 4]
        m, s = mean(chunk), pop_std(chunk)
        expected += [(r - m) / (s + EPS) for r in chunk]
    adv = compute_advantages(torch.tensor(rewards, dtype=torch.float64), groups, AdvantageConfig())
    close(adv, expected, tol=1e-5)
    # a group of equal rewards gets exactly zero advantage (eps keeps it finite)
    assert adv[12:].tolist() == [0.0] * 4
    # population, not sample, std: the unbiased std would give visibly different numbers
    unbiased = [(r - mean(rewards[:4])) / (torch.tensor(rewards[:4]).std().item() + EPS) for r in rewards[:4]]
    assert adv[0].item() != pytest.approx(unbiased[0], rel=1e-3)


def test_eps_is_configurable() -> None:
    adv = compute_advantages(torch.tensor(REWARDS), GROUPS, AdvantageConfig(eps=0.5))
    a = 1.0 / (math.sqrt(2.0 / 3.0) + 0.5)
    assert adv[2].item() == pytest.approx(a, rel=1e-6)


def test_group_scope_with_global_std() -> None:
    s = pop_std(REWARDS)  # std of the whole batch
    expected = [(r - mean(REWARDS[:3])) / (s + EPS) for r in REWARDS[:3]]
    expected += [(r - mean(REWARDS[3:])) / (s + EPS) for r in REWARDS[3:]]
    adv = compute_advantages(torch.tensor(REWARDS), GROUPS, AdvantageConfig(global_std=True))
    close(adv, expected)
    # means stay per group: each group sums to zero
    assert sum(adv[:3].tolist()) == pytest.approx(0.0, abs=1e-6)
    assert sum(adv[3:].tolist()) == pytest.approx(0.0, abs=1e-6)


def test_global_scope() -> None:
    m, s = mean(REWARDS), pop_std(REWARDS)
    expected = [(r - m) / (s + EPS) for r in REWARDS]
    adv = compute_advantages(torch.tensor(REWARDS), GROUPS, AdvantageConfig(scope="global"))
    close(adv, expected)
    # global scope ignores the grouping, so any group layout is accepted
    adv2 = compute_advantages(
        torch.tensor(REWARDS), ["x", "y", "x", "z", "y", "x"], AdvantageConfig(scope="global")
    )
    assert torch.equal(adv, adv2)


def test_clipping() -> None:
    rewards = [0.0, 0.0, 0.0, 10.0]
    m, s = mean(rewards), pop_std(rewards)
    raw = [(r - m) / (s + EPS) for r in rewards]
    assert raw[3] == pytest.approx(1.7320108084926162)
    adv = compute_advantages(torch.tensor(rewards), ["g"] * 4, AdvantageConfig(clip=1.0))
    close(adv, [max(-1.0, min(1.0, x)) for x in raw])
    assert adv[3].item() == 1.0
    adv = compute_advantages(torch.tensor([-r for r in rewards]), ["g"] * 4, AdvantageConfig(clip=1.5))
    assert adv[3].item() == -1.5
    assert adv[0].item() == pytest.approx(-raw[0], rel=1e-6)


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_clip_must_be_positive(clip: float) -> None:
    with pytest.raises(ValueError, match="advantage.clip must be > 0"):
        AdvantageConfig(clip=clip)


def test_unknown_scope() -> None:
    with pytest.raises(ValueError, match="advantage.scope"):
        AdvantageConfig(scope="batch")


def test_group_layout() -> None:
    assert group_layout(["a", "a", "b", "b", "c", "c"]) == (3, 2)
    assert group_layout(["a"]) == (1, 1)


def test_non_contiguous_groups_raise() -> None:
    groups = ["a", "a", "b", "b", "a", "a"]
    with pytest.raises(ValueError, match=r"group 'a' is not contiguous"):
        compute_advantages(torch.zeros(6), groups, AdvantageConfig())


def test_non_uniform_group_sizes_raise() -> None:
    with pytest.raises(ValueError, match=r"same size, got sizes \[1, 3\] for 2 groups"):
        compute_advantages(torch.zeros(4), ["a", "a", "a", "b"], AdvantageConfig())


def test_empty_batch_raises() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        compute_advantages(torch.zeros(0), [], AdvantageConfig())


def _track(rewards: torch.Tensor | None) -> RolloutTrack:
    n = 6
    seg = LatentSegment(
        latents=torch.zeros(n, 1, 1, 1, 1),
        positions=[1],
        sigmas=torch.tensor([1.0, 0.0]),
        sde_indices=[],
        log_probs=torch.zeros(n, 0),
        eta=0.0,
        guidance_scale=1.0,
    )
    return RolloutTrack(
        name="diffusion",
        sample_ids=[str(i) for i in range(n)],
        group_ids=GROUPS,
        prompts=[""] * n,
        metadata=[{} for _ in range(n)],
        segment=seg,
        rewards=rewards,
    )


def test_track_compute_advantages_sets_field() -> None:
    track = _track(torch.tensor(REWARDS))
    out = track_advantages(track, AdvantageConfig())
    assert out is track.advantages
    assert torch.equal(out, compute_advantages(torch.tensor(REWARDS), GROUPS, AdvantageConfig()))


def test_track_missing_rewards_raise() -> None:
    track = _track(None)
    with pytest.raises(ValueError, match="track 'diffusion' has no rewards"):
        track_advantages(track, AdvantageConfig())
    assert track.advantages is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1e-4, 1e-8])
@pytest.mark.parametrize("size", [2, 3, 7, 8, 24, 64, 1000])
def test_identical_rewards_give_exactly_zero_advantage(dtype: torch.dtype, eps: float, size: int) -> None:
    """Equal rewards that are not exactly representable (0.7, dense partial credit near 21, a weighted sum)
    must carry no push at all: every advantage is exactly 0, in every scope, beside a group that varies."""
    values = [0.7, 0.1, 1 / 3, 20.9, 21.0 + 1 / 7, 0.2 * 0.3 + 0.7 * 0.9, 1e-7, -3.3, 1234.5678]
    for value in values:
        rewards = torch.tensor([value] * size + [float(i) for i in range(size)], dtype=dtype)
        groups = ["same"] * size + ["varied"] * size
        for cfg in (
            AdvantageConfig(eps=eps),
            AdvantageConfig(eps=eps, global_std=True),
            AdvantageConfig(eps=eps, clip=5.0),
        ):
            adv = compute_advantages(rewards, groups, cfg)
            assert adv[:size].tolist() == [0.0] * size, (value, size, cfg)
            assert adv[size:].abs().max() > 0
        flat = compute_advantages(rewards[:size], ["g"] * size, AdvantageConfig(scope="global", eps=eps))
        assert flat.tolist() == [0.0] * size, (value, size)


def test_the_float32_formula_this_replaced_leaves_a_residue() -> None:
    """Guard that the test above covers a real failure: the same z-score in float32 gives every sample of
    an all-0.7 or all-21.14 group one nonzero sign (~6e-4 and ~0.019 at eps 1e-4)."""
    for value, n in ((0.7, 7), (0.7, 24), (21.0 + 1 / 7, 24)):
        r = torch.full((n,), value, dtype=torch.float32)
        old = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
        assert old.abs().min() > 1e-4 and (old > 0).all() != (old < 0).all()
        assert compute_advantages(r, ["g"] * n, AdvantageConfig()).tolist() == [0.0] * n


# ---- GDPO: each reward component normalised within its group, then the weighted sum over the batch
import numpy as np  # noqa: E402

from unirl.reward import LocalRewardBackend, RewardService  # noqa: E402
from unirl.reward.local import ColorTarget  # noqa: E402


def gdpo_by_hand(components: dict, weights: dict, group: int, eps: float) -> np.ndarray:
    total = 0.0
    for name, w in weights.items():
        c = np.asarray(components[name], dtype=np.float64).reshape(-1, group)
        z = (c - c.mean(axis=1, keepdims=True)) / (c.std(axis=1, keepdims=True) + eps)
        total = total + w * z.reshape(-1)
    return (total - total.mean()) / (total.std() + eps)


GDPO_GROUPS = ["g0"] * 4 + ["g1"] * 4


def test_gdpo_equals_the_formula_by_hand() -> None:
    comps = {"correct": [1, 0, 0, 1, 0.5, 0.2, 0.9, 0.1], "format": [0, 1, 1, 1, 1, 0, 0, 1]}
    weights = {"correct": 1.0, "format": 0.5}
    cfg = AdvantageConfig(multi_reward="gdpo")
    got = compute_advantages(
        torch.zeros(8), GDPO_GROUPS, cfg,
        components={k: torch.tensor(v) for k, v in comps.items()}, weights=weights,
    )  # fmt: skip
    np.testing.assert_allclose(got.numpy(), gdpo_by_hand(comps, weights, 4, cfg.eps), rtol=1e-5, atol=1e-6)
    assert abs(got.mean().item()) < 1e-6


def test_gdpo_keeps_apart_combinations_that_the_sum_collapses() -> None:
    """(correct, format) = (1, 0) and (0, 1) sum to the same reward, so GRPO gives them one
    advantage; GDPO weighs the rarer success in the group higher (GDPO's motivating case)."""
    comps = {"correct": torch.tensor([1.0, 0, 0, 0]), "format": torch.tensor([0.0, 1, 1, 0])}
    weights = {"correct": 1.0, "format": 1.0}
    grpo = compute_advantages(comps["correct"] + comps["format"], GDPO_GROUPS[:4], AdvantageConfig())
    assert grpo[0] == grpo[1] == grpo[2]
    gdpo = compute_advantages(
        torch.zeros(4), GDPO_GROUPS[:4], AdvantageConfig(multi_reward="gdpo"), components=comps, weights=weights
    )
    assert gdpo[0] > gdpo[1] == gdpo[2] > gdpo[3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"estimator": "rloo"},
        {"scope": "global"},
        {"norm_by_std": False},
        {"kl_coef": 0.1},
    ],
)
def test_gdpo_needs_the_group_zscore(kwargs) -> None:
    with pytest.raises(ValueError, match="advantage.multi_reward=gdpo normalises each component within its group"):
        AdvantageConfig(multi_reward="gdpo", **kwargs)
    with pytest.raises(ValueError, match="multi_reward must be one of"):
        AdvantageConfig(multi_reward="mean")


def test_gdpo_without_components_is_named() -> None:
    with pytest.raises(ValueError, match=r"needs the track's reward components and their weights"):
        compute_advantages(torch.zeros(4), GDPO_GROUPS[:4], AdvantageConfig(multi_reward="gdpo"))


def test_a_scored_track_gives_gdpo_its_components_and_weights() -> None:
    """The reward service records the weights beside the unweighted components; the track's
    advantages under gdpo are the formula's on them."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 4, 4), generator=g, dtype=torch.uint8)
    seg = LatentSegment(
        latents=torch.zeros(8, 1, 1, 1, 1), positions=[1], sigmas=torch.tensor([1.0, 0.0]), sde_indices=[],
        log_probs=torch.zeros(8, 0), eta=0.0, guidance_scale=1.0,
    )  # fmt: skip
    track = RolloutTrack(
        name="diffusion", sample_ids=[f"s{i}" for i in range(8)], group_ids=GDPO_GROUPS, prompts=["p"] * 8,
        metadata=[{} for _ in range(8)], segment=seg, media=images,
    )  # fmt: skip
    backend = LocalRewardBackend(
        components={"red": ColorTarget([1, 0, 0]), "green": ColorTarget([0, 1, 0])}, weights={"red": 1.0, "green": 0.3}
    )
    RewardService(backend).score_and_attach(track)
    assert track.reward_weights == {"red": 1.0, "green": 0.3}
    cfg = AdvantageConfig(multi_reward="gdpo")
    got = track_advantages(track, cfg)
    comps = {k: v.numpy() for k, v in track.reward_components.items()}
    np.testing.assert_allclose(got.numpy(), gdpo_by_hand(comps, track.reward_weights, 4, cfg.eps), rtol=1e-5, atol=1e-6)
