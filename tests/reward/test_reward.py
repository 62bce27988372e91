"""CPU tests of reward scorers, the local backend and the reward service."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from unirl.reward import (
    ColorTarget,
    JpegCompressibility,
    JpegIncompressibility,
    LocalRewardBackend,
    RewardError,
    RewardService,
)
from unirl.types import LatentSegment, RewardRequest, RolloutTrack

HYDRA_YAML = """
reward:
  _target_: unirl.reward.service.RewardService
  backend:
    _target_: unirl.reward.base.LocalRewardBackend
    components:
      brightness: {_target_: unirl.reward.local.color.ColorTarget, target: [1.0, 1.0, 1.0]}
      jpeg: {_target_: unirl.reward.local.jpeg.JpegIncompressibility}
    weights: {brightness: 1.0, jpeg: 0.01}
"""


def make_track(media: torch.Tensor | None, batch: int = 2) -> RolloutTrack:
    segment = LatentSegment(
        latents=torch.zeros(batch, 2, 4, 2, 2),
        positions=[0, 1],
        sigmas=torch.tensor([1.0, 0.0], dtype=torch.float32),
        sde_indices=[0],
        log_probs=torch.zeros(batch, 1),
        eta=0.7,
        guidance_scale=1.0,
    )
    return RolloutTrack(
        name="diffusion",
        sample_ids=[f"s{i}" for i in range(batch)],
        group_ids=["g0"] * batch,
        prompts=["a cat"] * batch,
        metadata=[{} for _ in range(batch)],
        segment=segment,
        media=media,
    )


def make_request(images: torch.Tensor) -> RewardRequest:
    n = images.shape[0]
    return RewardRequest(sample_ids=[f"s{i}" for i in range(n)], prompts=[""] * n, images=images)


def pil_jpeg_kb(image: torch.Tensor, quality: int) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000


def constant(values: list[float]):
    return lambda req: torch.tensor(values, dtype=torch.float32)


def test_jpeg_sizes_match_pil_and_noise_is_less_compressible():
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=gen)
    flat = torch.full((3, 32, 32), 128, dtype=torch.uint8)
    req = make_request(torch.stack([noise, flat]))

    size = JpegIncompressibility(quality=90)(req)
    assert size.dtype == torch.float32 and size.shape == (2,)
    assert size[0].item() == pytest.approx(pil_jpeg_kb(noise, 90))
    assert size[1].item() == pytest.approx(pil_jpeg_kb(flat, 90))
    assert size[0] > size[1]
    assert torch.equal(JpegCompressibility(quality=90)(req), -size)


def test_jpeg_rejects_bad_quality():
    with pytest.raises(ValueError, match="quality"):
        JpegCompressibility(quality=0)


def test_color_target_matches_hand_computation():
    # One 1x2 image: pixel A = (255, 0, 51), pixel B = (0, 0, 0); target (1, 0, 0.2).
    image = torch.tensor([[[255, 0]], [[0, 0]], [[51, 0]]], dtype=torch.uint8).unsqueeze(0)
    score = ColorTarget(target=[1.0, 0.0, 0.2])(make_request(image))
    # |diffs|: A = (0, 0, 0), B = (1, 0, 0.2) -> mean over 6 values = 1.2 / 6 = 0.2.
    assert score.shape == (1,)
    assert score.item() == pytest.approx(0.8, abs=1e-6)


def test_color_target_brightness_is_mean_intensity():
    image = torch.tensor([0, 255, 51, 102], dtype=torch.uint8).view(1, 1, 2, 2).expand(1, 3, 2, 2)
    score = ColorTarget()(make_request(image.contiguous()))
    assert score.item() == pytest.approx((0 + 1 + 0.2 + 0.4) / 4, abs=1e-6)


@pytest.mark.parametrize("target", [[1.0, 1.0], [0.5, 1.5, 0.0], [0.0, float("nan"), 0.0]])
def test_color_target_rejects_bad_target(target):
    with pytest.raises(ValueError, match="target"):
        ColorTarget(target=target)


def test_weighted_total_and_metrics():
    backend = LocalRewardBackend(
        components={"a": constant([1.0, 3.0]), "b": constant([2.0, -2.0])}, weights={"b": 0.5}
    )
    assert backend.weights == {"a": 1.0, "b": 0.5}
    track = make_track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    metrics = RewardService(backend).score_and_attach(track)

    # total = a + 0.5 * b = [1 + 1, 3 - 1] = [2, 2]
    assert track.rewards.dtype == torch.float32
    assert torch.allclose(track.rewards, torch.tensor([2.0, 2.0]))
    assert set(track.reward_components) == {"a", "b"}
    assert torch.equal(track.reward_components["b"], torch.tensor([2.0, -2.0]))
    assert metrics == pytest.approx(
        {
            "reward/mean": 2.0,
            "reward/std": 0.0,
            "reward/a/mean": 2.0,
            "reward/a/std": 1.0,
            "reward/b/mean": 0.0,
            "reward/b/std": 2.0,
        }
    )


def test_nan_reward_names_sample_and_component():
    backend = LocalRewardBackend(components={"ok": constant([1.0, 1.0]), "flaky": constant([0.0, math.nan])})
    track = make_track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(RewardError, match=r"'flaky'.*nan.*'s1'.*stopped"):
        RewardService(backend).score_and_attach(track)
    assert track.rewards is None


def test_missing_component_raises():
    class DroppingBackend(LocalRewardBackend):
        def score(self, req):
            resp = super().score(req)
            del resp.components["b"]
            return resp

    backend = DroppingBackend(components={"a": constant([1.0, 1.0]), "b": constant([1.0, 1.0])})
    with pytest.raises(RewardError, match="'b'"):
        RewardService(backend).score_and_attach(make_track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8)))


def test_bad_weights_key_and_empty_components_raise():
    with pytest.raises(ValueError, match=r"'typo'.*known components.*'a'"):
        LocalRewardBackend(components={"a": constant([1.0])}, weights={"typo": 1.0})
    with pytest.raises(ValueError, match="at least one component"):
        LocalRewardBackend(components={})


def test_scorer_shape_and_exception_name_the_component():
    req = make_request(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'wide'"):
        LocalRewardBackend(components={"wide": lambda r: torch.zeros(2, 1)}).score(req)

    def broken(r):
        raise KeyError("no such model")

    with pytest.raises(KeyError, match="'broken'.*no such model"):
        LocalRewardBackend(components={"broken": broken}).score(req)


def test_track_without_media_raises():
    service = RewardService(LocalRewardBackend(components={"a": constant([1.0, 1.0])}))
    with pytest.raises(ValueError, match="'diffusion'.*no media"):
        service.score_and_attach(make_track(None))


def test_hydra_yaml_instantiates_and_scores():
    service = instantiate(OmegaConf.create(HYDRA_YAML).reward, _convert_="all")
    assert isinstance(service, RewardService)
    assert service.backend.weights == {"brightness": 1.0, "jpeg": 0.01}

    white = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    track = make_track(white)
    metrics = service.score_and_attach(track)
    jpeg_kb = pil_jpeg_kb(white[0], 95)
    assert track.reward_components["brightness"].tolist() == [1.0, 1.0]
    assert metrics["reward/mean"] == pytest.approx(1.0 + 0.01 * jpeg_kb, rel=1e-6)


def test_unweighted_extra_component_raises():
    class ExtraBackend(LocalRewardBackend):
        def score(self, req):
            resp = super().score(req)
            resp.components["debug"] = torch.zeros(2)
            return resp

    backend = ExtraBackend(components={"a": constant([1.0, 1.0])})
    with pytest.raises(RewardError, match="'debug'"):
        RewardService(backend).score_and_attach(make_track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8)))
