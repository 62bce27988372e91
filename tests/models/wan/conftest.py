"""A tiny latent-space Wan 2.1 shared by this package's tests (built once, offline)."""

from __future__ import annotations

import pytest

from unirl.models.wan import TinyWanConfig, WanModelConfig


def tiny_wan_config(num_frames: int = 5, **overrides) -> WanModelConfig:
    """A tiny Wan with a causal video VAE (2x spatial, 2x temporal, per-channel latent
    normalization): 5 frames -> 3 latent frames."""
    tiny = dict(resolution=16, pixel_space=False, seed=0)
    tiny.update(overrides)
    return WanModelConfig(tiny=TinyWanConfig(**tiny), num_frames=num_frames)


@pytest.fixture(scope="package")
def wan_bundle():
    return tiny_wan_config().build()
