"""The differentiable reward contract: components, the weighted total, and its errors."""

from __future__ import annotations

import pytest
import torch

from unirl.reward import LocalRewardBackend, RewardService
from unirl.reward.local.color import ColorTarget
from unirl.reward.local.control import RandomReward
from unirl.types.reward import DifferentiableReward, RewardRequest


def _images(n: int = 3) -> torch.Tensor:
    return torch.rand((n, 3, 4, 4), generator=torch.Generator().manual_seed(0))


def test_color_target_differentiable_score_and_gradient_by_hand():
    images = _images().requires_grad_(True)
    scorer = ColorTarget([1.0, 0.0, 0.5])
    assert isinstance(scorer, DifferentiableReward)
    score = scorer.score_differentiable(images, ["p"] * 3, [])
    target = torch.tensor([1.0, 0.0, 0.5]).view(1, 3, 1, 1)
    torch.testing.assert_close(score, 1 - (images.detach() - target).abs().mean(dim=(1, 2, 3)))
    score.sum().backward()
    torch.testing.assert_close(images.grad, -torch.sign(images.detach() - target).expand(3, 3, 4, 4) / 48)
    # the scorer path is the differentiable one on round(255 x) / 255
    u8 = (images.detach() * 255).round().to(torch.uint8)
    req = RewardRequest(sample_ids=["a", "b", "c"], prompts=["p"] * 3, images=u8)
    torch.testing.assert_close(scorer(req), scorer.score_differentiable(u8.float() / 255, [], []))


def test_service_weighs_the_differentiable_components_and_skips_zero_weights():
    red, blue = ColorTarget([1.0, 0.0, 0.0]), ColorTarget([0.0, 0.0, 1.0])
    service = RewardService(
        LocalRewardBackend(
            {"red": red, "blue": blue, "monitor": RandomReward()}, {"red": 2.0, "blue": -0.5, "monitor": 0.0}
        )
    )
    images = _images().requires_grad_(True)
    total = service.score_differentiable(images, ["p"] * 3, [{}] * 3)
    expected = 2.0 * red.score_differentiable(images, [], []) - 0.5 * blue.score_differentiable(
        images, [], []
    )
    torch.testing.assert_close(total, expected)
    total.sum().backward()
    assert images.grad.abs().sum() > 0


def test_a_weighted_non_differentiable_component_is_named():
    service = RewardService(
        LocalRewardBackend({"red": ColorTarget([1.0, 0.0, 0.0]), "random": RandomReward()})
    )
    with pytest.raises(
        ValueError,
        match=r"reward component 'random' \(RandomReward\) has weight 1.0 but is not differentiable",
    ):
        service.score_differentiable(_images(), ["p"] * 3, [])


def test_all_zero_weights_is_an_error():
    service = RewardService(LocalRewardBackend({"red": ColorTarget([1.0, 0.0, 0.0])}, {"red": 0.0}))
    with pytest.raises(ValueError, match="no reward component has a non-zero weight"):
        service.score_differentiable(_images(), ["p"] * 3, [])


def test_misshapen_differentiable_output_is_named():
    class Bad(ColorTarget):
        def score_differentiable(self, images, prompts, metadata):
            return images.mean(dim=(2, 3))

    service = RewardService(LocalRewardBackend({"bad": Bad()}))
    with pytest.raises(
        ValueError, match=r"reward component 'bad' must return a \[B=3\] tensor, got \[3, 3\]"
    ):
        service.score_differentiable(_images(), ["p"] * 3, [])


def test_reward_backprop_algorithms_check_the_reward_when_built():
    from unirl.algorithms.draft import DRaFT

    bad = RewardService(LocalRewardBackend({"red": ColorTarget([1.0, 0.0, 0.0]), "random": RandomReward()}))
    with pytest.raises(ValueError, match="reward component 'random'"):
        bad.check_differentiable()
    with pytest.raises(ValueError, match="reward component 'random'"):
        DRaFT(bad)
    ok = RewardService(
        LocalRewardBackend({"red": ColorTarget([1.0, 0.0, 0.0]), "random": RandomReward()}, {"random": 0.0})
    )
    assert DRaFT(ok).reward is ok


def test_random_direction_control_gradient_by_hand_and_one_direction_per_image():
    from unirl.reward.local.control import RandomDirectionReward

    control = RandomDirectionReward(seed=3)
    assert isinstance(control, DifferentiableReward)
    u8 = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images = (u8.float() / 255).requires_grad_(True)
    score = control.score_differentiable(images, ["p", "q"], [])
    d = images[0].numel()
    w = torch.stack([control.direction(img) for img in images.detach()])
    s = torch.sigmoid((w * (2 * images.detach() - 1)).flatten(1).sum(1) / d**0.5)
    torch.testing.assert_close(score, s)
    score.sum().backward()
    torch.testing.assert_close(images.grad, w * (2 * s * (1 - s) / d**0.5).view(-1, 1, 1, 1))
    req = RewardRequest(sample_ids=["a", "b"], prompts=["p", "q"], images=u8)
    torch.testing.assert_close(control(req), s)  # the scorer hashes the same pixels
    cos = torch.nn.functional.cosine_similarity(w[0].flatten(), w[1].flatten(), dim=0)
    assert abs(float(cos)) < 0.2  # a direction per image
    assert not torch.equal(RandomDirectionReward(seed=4).direction(images[0].detach()), w[0])
