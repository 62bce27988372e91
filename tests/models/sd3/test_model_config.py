"""SD3 as a family on the shared flow-matching stage: its bundle and config satisfy the family
contract, and the config answers the validator's directory and image-size questions itself."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_model_config
from unirl.models.flow import FlowFamily, FlowMatchingStage, FlowModelConfig
from unirl.models.sd3 import SD3ModelConfig, SD3Stage


def test_bundle_and_config_satisfy_the_family_contract(tiny_bundle) -> None:
    assert isinstance(tiny_bundle, FlowFamily)
    assert isinstance(tiny_model_config(), FlowModelConfig)
    assert SD3Stage is FlowMatchingStage
    assert FlowMatchingStage(tiny_bundle).module is tiny_bundle.transformer


def fits(bundle, resolution: int, height: int, width: int) -> bool:
    """Whether the built model takes the size: its latent grid divides it and it is not larger
    than the tiny model's position embedding."""
    try:
        bundle.latent_shape(height, width)
    except ValueError:
        return False
    return max(height, width) <= resolution


@pytest.mark.parametrize(
    "tiny",
    [
        dict(resolution=16, patch_size=4),
        dict(resolution=32, patch_size=2, pixel_space=False, vae_downsample=4),
    ],
)
def test_size_problems_agree_with_the_built_geometry(tiny) -> None:
    config = tiny_model_config(**tiny)
    bundle = config.build()
    for height, width in [(16, 16), (12, 16), (16, 20), (24, 24), (32, 16), (40, 40), (8, 8)]:
        problems = config.size_problems(height, width)
        assert (problems == []) == fits(bundle, tiny["resolution"], height, width), (height, width, problems)
        for p in problems:
            assert p.startswith(("sampling.height=", "sampling.width="))


def test_size_problems_of_a_directory_read_its_configs(tmp_path) -> None:
    bundle = tiny_model_config(resolution=32, patch_size=2, pixel_space=False, vae_downsample=4).build()
    bundle.save_pretrained(str(tmp_path))
    config = SD3ModelConfig(pretrained_path=str(tmp_path), tiny=None)
    assert config.directory_problems() == []
    cell = bundle.vae_scale_factor * bundle.patch_size
    assert cell == 8
    assert config.size_problems(64, 8) == []  # no position-embedding bound read from a directory
    assert config.size_problems(36, 64) == [
        "sampling.height=36 must be a multiple of 8, the pixels per latent patch of the model"
    ]


def test_directory_of_another_family_is_named(tmp_path) -> None:
    with open(tmp_path / "model_index.json", "w") as f:
        json.dump({"_class_name": "FluxPipeline"}, f)
    (problem,) = SD3ModelConfig(pretrained_path=str(tmp_path), tiny=None).directory_problems()
    assert problem.startswith("model.pretrained_path: ") and "'FluxPipeline'" in problem
    assert "not StableDiffusion3Pipeline" in problem


def test_missing_directory_is_named(tmp_path) -> None:
    (problem,) = SD3ModelConfig(pretrained_path=str(tmp_path / "no"), tiny=None).directory_problems()
    assert problem.startswith(f"model.pretrained_path: '{tmp_path / 'no'}' is not a directory")
    assert SD3ModelConfig().directory_problems() == []
