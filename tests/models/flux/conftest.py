"""A tiny latent-space FLUX.1 shared by this package's tests (built once, offline)."""

from __future__ import annotations

import pytest

from unirl.models.flux import FluxModelConfig, TinyFluxConfig


def tiny_flux_config(**overrides) -> FluxModelConfig:
    """A tiny FLUX with a VAE (2x downsample, FLUX's latent scaling and shift), 8-token CLIP."""
    tiny = dict(resolution=32, pixel_space=False, clip_max_length=8, seed=0)
    tiny.update(overrides)
    return FluxModelConfig(tiny=TinyFluxConfig(**tiny))


@pytest.fixture(scope="package")
def flux_bundle():
    return tiny_flux_config().build()
