"""Wan 2.1 as a family on the shared stage: the contract, its video geometry, and bad input
refused by the validator before Ray, each problem naming the recipe key and the valid values."""

from __future__ import annotations

import json

import pytest

from tests.recipes import recipe
from unirl.config.tree import ConfigError
from unirl.models.flow import FlowFamily, FlowMatchingStage, FlowModelConfig
from unirl.models.wan import WanModelConfig, WanStage

from .conftest import tiny_wan_config

RECIPE = "diffusion/tiny_wan_flowgrpo"


def test_bundle_and_config_satisfy_the_family_contract(wan_bundle) -> None:
    assert isinstance(wan_bundle, FlowFamily) and isinstance(tiny_wan_config(), FlowModelConfig)
    assert WanStage is FlowMatchingStage and wan_bundle.guidance == "cfg"
    # 2x spatial, 2x temporal VAE: 5 frames of 16 px -> 3 latent frames of 8x8 -> 3 x 4x4 tokens
    assert wan_bundle.latent_shape(16, 16) == (4, 3, 8, 8) and wan_bundle.image_seq_len(16, 16) == 48
    assert wan_bundle.model_info() == {
        "pixel_space": False, "vae_scale_factor": 2, "patch_size": 2, "num_frames": 5,
    }  # fmt: skip
    with pytest.raises(ValueError, match="model.num_frames=4: this Wan VAE \\(temporal compression 2\\)"):
        tiny_wan_config(num_frames=4).build()


def test_size_problems_agree_with_the_geometry(tmp_path) -> None:
    for frames in (1, 5, 9, 4, 6):
        for height, width in [(16, 16), (12, 16), (16, 6), (8, 20)]:
            problems = tiny_wan_config(num_frames=frames).size_problems(height, width)
            fits = height % 4 == 0 and width % 4 == 0 and frames % 2 == 1
            assert (problems == []) == fits, (frames, height, width, problems)
    assert tiny_wan_config(num_frames=4, pixel_space=True).size_problems(6, 6) == []  # no VAE: any count
    # a directory: Wan's real VAE (8x spatial, 4x temporal) from vae/config.json
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(
        json.dumps({"scale_factor_temporal": 4, "scale_factor_spatial": 8})
    )
    config = WanModelConfig(pretrained_path=str(tmp_path), tiny=None, num_frames=80)
    assert config.size_problems(480, 840) == [
        "sampling.width=840 must be a multiple of 16 (Wan patches 2x2 latent cells of 8 px), e.g. 832 or 848",
        "model.num_frames=80: Wan's VAE (temporal compression 4) takes 1 + 4k frames (1, 5, 9, ...), e.g. 77 or 81",
    ]


@pytest.fixture
def other_family_dir(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return tmp_path


LATENT = ["model.tiny.pixel_space=false", "+model.tiny.vae_spatial=4", "+model.tiny.vae_temporal=4"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [*LATENT, "model.num_frames=8"],
            "model.num_frames=8: Wan's VAE (temporal compression 4) takes 1 + 4k",
        ),
        ([*LATENT, "sampling.height=20"], "sampling.height=20 must be a multiple of 8"),
        (["model.tiny.attention_head_dim=13"], "model.tiny.attention_head_dim must be even and >= 6"),
        (["model.tiny=null", "model.pretrained_path=DIR"], "names 'FluxPipeline', not WanPipeline"),
    ],
)
def test_bad_input_is_refused_naming_the_key(tmp_path, other_family_dir, overrides, expected) -> None:
    overrides = [o.replace("DIR", str(other_family_dir)) for o in overrides]
    with pytest.raises(ConfigError) as err:
        recipe(RECIPE, tmp_path / "out", *overrides, expect="diffusion")
    assert expected in str(err.value), str(err.value)
