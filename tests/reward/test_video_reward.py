"""Rewards over videos: a per-frame image scorer averaged over frames, and the colour-motion
reward, against hand computations; image scorers refuse videos and video scorers images."""

from __future__ import annotations

import pytest
import torch

from unirl.reward.local import ColorMotion, ColorTarget, FrameMean
from unirl.types.reward import RewardRequest


def request(videos: torch.Tensor) -> RewardRequest:
    b = videos.shape[0]
    return RewardRequest(sample_ids=[f"s{i}" for i in range(b)], prompts=["p"] * b, images=videos)


def moving_square(frames: int, size: int = 12, side: int = 3, step: int = 2, rgb=(255, 0, 0)) -> torch.Tensor:
    """[F, 3, size, size] uint8: a `side`-pixel square of `rgb` on black, `step` px further right
    each frame, from column 1."""
    video = torch.zeros(frames, 3, size, size, dtype=torch.uint8)
    for k in range(frames):
        col = 1 + k * step
        video[k, :, 4 : 4 + side, col : col + side] = torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1)
    return video


def test_frame_mean_is_the_mean_of_the_per_frame_scores() -> None:
    videos = torch.randint(
        0, 256, (2, 3, 3, 4, 5), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    scores = FrameMean(ColorTarget([1.0, 0.0, 0.0]))(request(videos))
    target = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)
    for i in range(2):  # by hand: 1 - mean |pixel / 255 - target| per frame, then over frames
        per_frame = [1 - (videos[i, k].float() / 255 - target).abs().mean() for k in range(3)]
        assert scores[i].item() == pytest.approx(sum(per_frame).item() / 3, abs=1e-6)
    floats = videos.float().div(255).requires_grad_()
    diff = FrameMean(ColorTarget([1.0, 0.0, 0.0])).score_differentiable(floats, ["p", "p"], [{}, {}])
    torch.testing.assert_close(diff, scores, rtol=0, atol=1e-6)
    diff.sum().backward()
    assert floats.grad is not None and floats.grad.abs().sum() > 0


def test_color_motion_rewards_a_red_object_moving_right() -> None:
    right = moving_square(4)
    still = moving_square(4, step=0)
    videos = torch.stack([right, right.flip(0), still, torch.zeros_like(still)])
    scores = ColorMotion([1.0, 0.0, 0.0], "right")(request(videos))
    # by hand: the square's columns 1..3 -> centre 2.5 px, then 8.5 px after 3 steps of 2 px, of 12
    moved = (8.5 - 2.5) / 12
    torch.testing.assert_close(scores, torch.tensor([moved, -moved, 0.0, 0.0]), rtol=0, atol=1e-6)
    assert ColorMotion([1.0, 0.0, 0.0], "left")(request(videos))[1].item() == pytest.approx(moved)
    blue = torch.stack([moving_square(4, rgb=(0, 0, 255))])  # moves, but is not the colour
    assert ColorMotion([1.0, 0.0, 0.0])(request(blue)).item() == 0.0
    # floor 0: the wrong way scores as a still video; the right way and still ones are unchanged
    floored = ColorMotion([1.0, 0.0, 0.0], "right", floor=0.0)(request(videos))
    torch.testing.assert_close(floored, torch.tensor([moved, 0.0, 0.0, 0.0]), rtol=0, atol=1e-6)
    half = ColorMotion([1.0, 0.0, 0.0], "right", floor=-0.25)(request(videos))
    torch.testing.assert_close(half, torch.tensor([moved, -0.25, 0.0, 0.0]), rtol=0, atol=1e-6)


def test_color_motion_weighs_pixels_by_closeness_to_the_colour() -> None:
    """A near-red pixel counts at its weight 1 - 2 max_c |p - t| (here 0.6); black pixels count 0."""
    video = torch.zeros(2, 3, 1, 4, dtype=torch.uint8)
    video[0, 0, 0, 0] = 255  # frame 0: pure red at column 0 (x = 0.125)
    video[1, 0, 0, 0] = 255
    video[1, :, 0, 3] = torch.tensor([204, 51, 0], dtype=torch.uint8)  # frame 1: + (0.8, 0.2, 0) at x = 0.875
    w = 1 - 2 * 0.2
    expected = (0.125 + w * 0.875) / (1 + w) - 0.125
    assert ColorMotion()(request(video[None])).item() == pytest.approx(expected, abs=1e-6)


def test_image_and_video_scorers_refuse_the_other_modality() -> None:
    videos = torch.zeros(1, 2, 3, 4, 4, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match="ColorTarget scores images, but the request carries videos.*FrameMean"
    ):
        ColorTarget()(request(videos))
    with pytest.raises(
        ValueError, match=r"ColorMotion needs videos \[B, F, 3, H, W\], but the request carries images"
    ):
        ColorMotion()(request(videos[:, 0]))
    with pytest.raises(ValueError, match="direction must be 'right' or 'left'"):
        ColorMotion(direction="up")
    for floor in (0.5, -2.0, "0"):
        with pytest.raises(ValueError, match=r"floor must be null or in \[-1, 0\]"):
            ColorMotion(floor=floor)
    with pytest.raises(ValueError, match="must be uint8 \\[B, 3, H, W\\] \\(or videos"):
        request(torch.zeros(1, 2, 4, 4, 4, dtype=torch.uint8))


def test_the_remote_wire_refuses_videos() -> None:
    from unirl.reward.wire import encode_request

    with pytest.raises(ValueError, match="carries images and texts, not videos"):
        encode_request(request(torch.zeros(1, 2, 3, 4, 4, dtype=torch.uint8)))


def test_color_motion_is_differentiable_and_scores_as_the_scorer() -> None:
    """`score_differentiable` of float frames equals the scorer's score of the same uint8 frames, and
    its gradient is the centroid's: by hand for one half-red pixel, and by central differences."""
    videos = torch.stack([moving_square(4), moving_square(4).flip(0), moving_square(4, step=0)])
    floats = videos.float().div(255)
    motion = ColorMotion([1.0, 0.0, 0.0], "right")
    torch.testing.assert_close(
        motion.score_differentiable(floats, ["p"] * 3, []), motion(request(videos)), rtol=0, atol=1e-6
    )
    # by hand: frame 0 has red at column 0 (x = 1/8) and one pixel at column 3 (x = 7/8) whose red
    # channel r gives it weight w = 1 - 2 (1 - r); the last frame is red at column 3 alone, so the score
    # is 7/8 - c0 with c0 = (1/8 + w 7/8) / (1 + w) and d score / dr = -2 dc0/dw = -2 (6/8) / (1 + w)^2
    video = torch.zeros(1, 2, 3, 1, 4)
    video[0, 0, 0, 0, 0] = 1.0
    video[0, 1, 0, 0, 3] = 1.0
    r = 0.8
    video[0, 0, 0, 0, 3] = r
    video.requires_grad_()
    score = motion.score_differentiable(video, ["p"], [])
    w = 1 - 2 * (1 - r)
    assert score.item() == pytest.approx(7 / 8 - (1 / 8 + w * 7 / 8) / (1 + w), abs=1e-6)
    score.sum().backward()
    assert video.grad[0, 0, 0, 0, 3].item() == pytest.approx(-2 * (6 / 8) / (1 + w) ** 2, rel=1e-5)
    # central differences in fp64 (the float path itself, below score_differentiable's fp32 cast) on a
    # random near-red video, at pixel channels that carry weight
    gen = torch.Generator().manual_seed(0)
    clip = (
        torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 3, 1, 1) + 0.3 * torch.rand(1, 3, 3, 2, 3, generator=gen)
    ).clamp(0, 1)
    clip = clip.double().requires_grad_()
    (grad,) = torch.autograd.grad(motion.score_differentiable(clip, ["p"], []).sum(), clip)
    eps = 1e-6
    for idx in [(0, 0, 0, 0, 1), (0, 2, 1, 1, 2), (0, 1, 2, 0, 0), (0, 2, 0, 1, 0)]:
        hi, lo = clip.detach().clone(), clip.detach().clone()
        hi[idx] += eps
        lo[idx] -= eps
        numeric = (motion._score(motion._centroids(hi)) - motion._score(motion._centroids(lo))) / (2 * eps)
        assert grad[idx].item() == pytest.approx(numeric.item(), abs=1e-6)
    with pytest.raises(ValueError, match=r"ColorMotion scores videos \[B, F, 3, H, W\]"):
        motion.score_differentiable(floats[:, 0], ["p"] * 3, [])
