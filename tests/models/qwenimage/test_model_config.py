"""Qwen-Image as a family on the shared stage: the contract, its geometry, and bad input refused by
the validator before Ray, each problem naming the recipe key."""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes import recipe
from unirl.config.tree import ConfigError
from unirl.models.flow import FlowFamily, FlowMatchingStage, FlowModelConfig, TrueCFGGuidance
from unirl.models.qwenimage import QwenImageModelConfig, QwenImageStage

from .conftest import tiny_qwenimage_config

RECIPE = "diffusion/tiny_qwenimage_flowgrpo"


def test_bundle_and_config_satisfy_the_family_contract(qwen_bundle) -> None:
    assert isinstance(qwen_bundle, FlowFamily) and isinstance(tiny_qwenimage_config(), FlowModelConfig)
    assert QwenImageStage is FlowMatchingStage and qwen_bundle.guidance == "true_cfg" and isinstance(qwen_bundle, TrueCFGGuidance)
    # 2x VAE: 32 px -> 16x16 latents -> 8x8 packed tokens of 4 x 4 channels
    assert qwen_bundle.latent_shape(32, 32) == (4, 16, 16) and qwen_bundle.image_seq_len(32, 32) == 64
    assert qwen_bundle.model_info() == {"pixel_space": False, "vae_scale_factor": 2, "patch_size": 2}


def test_guided_encoding_has_the_negative_prompt_twins(qwen_bundle) -> None:
    qwen_bundle.negative_prompt = " "
    stage = QwenImageStage(qwen_bundle)
    cond = stage.encode_prompts(["a red square", "a blue dot", "a red square"], 4.0, 12)
    assert {k: tuple(v.shape) for k, v in cond.items()} == {
        "prompt_embeds": (3, 12, 32),
        "prompt_embeds_mask": (3, 12),
        "negative_prompt_embeds": (3, 12, 32),
        "negative_prompt_embeds_mask": (3, 12),
    }
    # " " is 6 tokens after the template prefix, the prompts 8; the rest is zero padding
    assert cond["negative_prompt_embeds_mask"].sum(1).tolist() == [6, 6, 6]
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [8, 8, 8]
    assert not cond["prompt_embeds"][:, 8:].any()
    assert set(stage.encode_prompts(["a red square"], 1.0, 12)) == {"prompt_embeds", "prompt_embeds_mask"}
    qwen_bundle.negative_prompt = None
    with pytest.raises(ValueError, match="model.negative_prompt"):
        stage.encode_prompts(["a red square"], 4.0, 12)
    qwen_bundle.negative_prompt = " "


def test_size_problems_agree_with_the_geometry(tmp_path) -> None:
    config = tiny_qwenimage_config()
    for height, width in [(32, 32), (36, 32), (32, 8), (8, 6), (48, 64)]:
        problems = config.size_problems(height, width)
        fits = height % 4 == 0 and width % 4 == 0
        assert (problems == []) == fits, (height, width, problems)
    # a directory: Qwen-Image's 8x VAE (three downsamples) needs multiples of 16, read from vae/config.json
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"temperal_downsample": [False, True, True]}))
    assert QwenImageModelConfig(pretrained_path=str(tmp_path), tiny=None).size_problems(520, 512) == [
        "sampling.height=520 must be a multiple of 16 (Qwen-Image packs 2x2 latent cells of 8 px), e.g. 512 or 528"
    ]


@pytest.fixture
def other_family_dir(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return tmp_path


LATENT_8X = [
    "model.tiny.pixel_space=false",
    "+model.tiny.vae_downsample=8",
]  # Qwen-Image's VAE scale: 16 px cells


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([*LATENT_8X, "sampling.height=40"], "sampling.height=40 must be a multiple of 16"),
        ([*LATENT_8X, "sampling.width=24"], "sampling.width=24 must be a multiple of 16"),
        (["model.negative_prompt=null"], "sampling.guidance_scale=4.0 runs Qwen-Image's true CFG"),
        (["model.tiny=null", "model.pretrained_path=DIR"], "names 'FluxPipeline', not QwenImagePipeline"),
    ],
)
def test_bad_input_is_refused_naming_the_key(tmp_path, other_family_dir, overrides, expected) -> None:
    overrides = [o.replace("DIR", str(other_family_dir)) for o in overrides]
    with pytest.raises(ConfigError) as err:
        recipe(RECIPE, tmp_path / "out", *overrides, expect="diffusion")
    assert expected in str(err.value), str(err.value)


def test_no_negative_prompt_is_fine_without_guidance(tmp_path) -> None:
    cfg = recipe(
        RECIPE,
        tmp_path / "out",
        "model.negative_prompt=null",
        "sampling.guidance_scale=1.0",
        expect="diffusion",
    )
    assert cfg.model.negative_prompt is None


def test_a_saved_pixel_space_model_loads_from_its_directory(tmp_path) -> None:
    """Tiny from a config, saved in the diffusers layout (no vae/: pixel space), built back from the
    directory by the model config: the same weights, the same text encoding, the same velocity
    within 1e-6."""
    tiny = tiny_qwenimage_config(pixel_space=True, resolution=16).build()
    tiny.save_pretrained(str(tmp_path))
    loaded = QwenImageModelConfig(pretrained_path=str(tmp_path), tiny=None).build()
    assert (
        loaded.vae is None
        and loaded.model_info()["pixel_space"]
        and loaded.latent_shape(16, 16) == (3, 16, 16)
    )
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = loaded.encode_text(["a red square"], False, 8)
        assert torch.equal(
            cond["prompt_embeds"], tiny.encode_text(["a red square"], False, 8)["prompt_embeds"]
        )
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, torch.tensor([0.5]), cond),
            tiny.predict(
                tiny.transformer, x, torch.tensor([0.5]), tiny.encode_text(["a red square"], False, 8)
            ),
            rtol=0,
            atol=1e-6,  # measured 3.6e-7: the loaded module's fp32 forward differs slightly (not traced)
        )
    loaded_state = loaded.transformer.state_dict()
    assert all(torch.equal(v, loaded_state[k]) for k, v in tiny.transformer.state_dict().items())
