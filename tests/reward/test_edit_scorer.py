"""`SourcePreservation`: an edit's result scored against the source its prompt row carries, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unirl.reward.local import SourcePreservation
from unirl.types import RewardRequest


def request(images: torch.Tensor, metadata: list[dict]) -> RewardRequest:
    n = len(images)
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(n)], prompts=["edit"] * n, images=images, metadata=metadata
    )


def test_scores_equal_one_minus_the_mean_difference_to_the_source(tmp_path) -> None:
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(source).save(tmp_path / "src.png")
    same = torch.from_numpy(source).permute(2, 0, 1)
    other = torch.from_numpy(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).permute(2, 0, 1)
    meta = [{"images": [str(tmp_path / "src.png")]}, {"images": [source]}]
    got = SourcePreservation()(request(torch.stack([same, other]), meta))
    by_hand = 1.0 - np.abs(other.numpy().astype(np.float64) / 255 - source.transpose(2, 0, 1) / 255).mean()
    assert got[0].item() == 1.0
    assert got[1].item() == pytest.approx(by_hand, abs=1e-6)


def test_a_source_of_another_size_is_resized_and_a_missing_one_named(tmp_path) -> None:
    Image.new("RGB", (16, 16), (255, 0, 0)).save(tmp_path / "red.png")
    red = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    red[:, 0] = 255
    assert SourcePreservation()(request(red, [{"images": [str(tmp_path / "red.png")]}])).item() == 1.0
    with pytest.raises(ValueError, match=r"sample 's0'.*metadata 'images'\[0\]"):
        SourcePreservation()(request(red, [{}]))


def test_it_is_differentiable() -> None:
    source = np.full((4, 4, 3), 128, dtype=np.uint8)
    images = torch.full((1, 3, 4, 4), 0.25, requires_grad=True)
    score = SourcePreservation().score_differentiable(images, ["edit"], [{"images": [source]}])
    score.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
