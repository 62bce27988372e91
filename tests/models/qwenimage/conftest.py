"""A tiny latent-space Qwen-Image shared by this package's tests (built once, offline)."""

from __future__ import annotations

import pytest

from unirl.models.qwenimage import QwenImageModelConfig, TinyQwenImageConfig

WORDS = ["red", "blue", "square", "dot"]


def tiny_qwenimage_config(**overrides) -> QwenImageModelConfig:
    """A tiny Qwen-Image with an AutoencoderKLQwenImage (2x downsample, per-channel latent mean /
    std), a tiny Qwen2.5-VL encoder; the test prompts' words are whole tokens."""
    tiny = dict(resolution=32, pixel_space=False, words=WORDS, seed=0)
    tiny.update(overrides)
    return QwenImageModelConfig(tiny=TinyQwenImageConfig(**tiny))


@pytest.fixture(scope="package")
def qwen_bundle():
    return tiny_qwenimage_config().build()
