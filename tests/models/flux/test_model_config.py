"""FLUX.1 as a family on the shared stage: the contract, its geometry, and bad input refused by
the validator before Ray, each problem naming the recipe key."""

from __future__ import annotations

import json

import pytest

from tests.recipes import recipe
from unirl.config.tree import ConfigError
from unirl.models.flow import FlowFamily, FlowMatchingStage, FlowModelConfig
from unirl.models.flux import FluxKontextModelConfig, FluxModelConfig, FluxStage, TinyFluxConfig
from unirl.models.sd3 import TinySD3Config

from .conftest import tiny_flux_config

RECIPE = "diffusion/tiny_flux_flowgrpo"


def test_bundle_and_config_satisfy_the_family_contract(flux_bundle) -> None:
    assert isinstance(flux_bundle, FlowFamily) and isinstance(tiny_flux_config(), FlowModelConfig)
    assert FluxStage is FlowMatchingStage and flux_bundle.guidance == "embedded"
    # 2x VAE: 32 px -> 16x16 latents -> 8x8 packed tokens of 4 x 4 channels
    assert flux_bundle.latent_shape(32, 32) == (4, 16, 16) and flux_bundle.image_seq_len(32, 32) == 64
    assert flux_bundle.model_info() == {"pixel_space": False, "vae_scale_factor": 2, "patch_size": 2}


def test_size_problems_agree_with_the_geometry(flux_bundle, tmp_path) -> None:
    config = tiny_flux_config()
    for height, width in [(32, 32), (36, 32), (32, 8), (8, 4), (48, 64)]:
        problems = config.size_problems(height, width)
        fits = height % 4 == 0 and width % 4 == 0
        assert (problems == []) == fits, (height, width, problems)
    # a directory: FLUX's real 8x VAE needs multiples of 16, read from vae/config.json
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    assert FluxModelConfig(pretrained_path=str(tmp_path), tiny=None).size_problems(520, 512) == [
        "sampling.height=520 must be a multiple of 16 (FLUX packs 2x2 latent cells of 8 px), e.g. 512 or 528"
    ]


@pytest.fixture
def other_family_dir(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return tmp_path


LATENT_8X = ["model.tiny.pixel_space=false", "+model.tiny.vae_downsample=8"]  # FLUX's VAE scale: 16 px cells


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([*LATENT_8X, "sampling.height=40"], "sampling.height=40 must be a multiple of 16"),
        ([*LATENT_8X, "sampling.width=24"], "sampling.width=24 must be a multiple of 16"),
        (
            ["model.tiny.guidance_embeds=false"],
            "sampling.guidance_scale=3.5: this FLUX model has no guidance",
        ),
        (
            ["model.tiny=null", "model.pretrained_path=DIR"],
            "names 'StableDiffusion3Pipeline', not FluxPipeline",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_key(tmp_path, other_family_dir, overrides, expected) -> None:
    overrides = [o.replace("DIR", str(other_family_dir)) for o in overrides]
    with pytest.raises(ConfigError) as err:
        recipe(RECIPE, tmp_path / "out", *overrides, expect="diffusion")
    assert expected in str(err.value), str(err.value)


def test_a_tiny_config_of_another_family_is_refused_and_a_mapping_becomes_the_familys() -> None:
    assert FluxModelConfig.tiny_class() is TinyFluxConfig
    assert FluxKontextModelConfig.tiny_class() is TinyFluxConfig  # a variant keeps its family's
    assert isinstance(FluxModelConfig(tiny={"num_layers": 2}).tiny, TinyFluxConfig)
    with pytest.raises(
        ValueError, match=r"model.tiny: FLUX.1 builds a TinyFluxConfig .* got a TinySD3Config"
    ):
        FluxModelConfig(tiny=TinySD3Config())
    assert FluxModelConfig.SPEC.modeling == "unirl.models.flux.bundle"
