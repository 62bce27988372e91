"""A supervised track's pairing rules (`unirl.config.supervised`), refused before Ray naming the
keys: a supervised loss with the demonstrations' engine and no reward / advantage / critic, one
sample a row, a single-track recipe; an RL loss with a reward, an advantage and sampled rollouts."""

from __future__ import annotations

import pytest

from tests.recipes import composed
from unirl.config.validate import ConfigError, validate_recipe

SFT = "llm/arith_sft_smoke"
REWARD = (
    "+reward={_target_: unirl.reward.RewardService, backend: {_target_: unirl.reward.LocalRewardBackend, "
    "components: {answer: {_target_: worlds.arith.ArithAnswer}}}}"
)
GRPO = "algorithm={_target_: unirl.algorithms.grpo.GRPO}"
ADVANTAGE = "+advantage={_target_: unirl.types.AdvantageConfig, estimator: grpo}"
TRAINSIDE = ["rollout._target_=unirl.rollout.trainside.TrainsideEngine", "~rollout.target_key"]


def problems(tmp_path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate_recipe(composed(SFT, tmp_path, *overrides), expect="text")
    return str(info.value)


def test_the_supervised_recipes_validate(tmp_path):
    for name in (SFT, "llm/arith_sft", "vlm/shapes_vqa_sft"):
        validate_recipe(composed(name, tmp_path), expect="text")


def test_a_supervised_loss_needs_demonstrations_and_nothing_of_rl(tmp_path):
    found = problems(tmp_path, *TRAINSIDE, REWARD, ADVANTAGE, "sampling.samples_per_prompt=2")
    assert "rollout: LMSFT learns from the data's demonstrations; set rollout._target_=" in found
    assert "reward: LMSFT learns from demonstrations, not rewards; set reward: null" in found
    assert "advantage: LMSFT learns from demonstrations, not rewards; set advantage: null" in found
    assert "sampling.samples_per_prompt=2: a row has one demonstration" in found


def test_an_rl_loss_needs_samples_a_reward_and_an_advantage(tmp_path):
    found = problems(tmp_path, GRPO)
    assert (
        "rollout: DemonstrationEngine gives the data's demonstrations, not samples of the policy, and GRPO"
        in found
    )
    assert "reward is null, but GRPO trains on rewards through advantages" in found
    assert "advantage is null, but GRPO trains on rewards through advantages" in found


def test_a_composed_track_cannot_be_supervised(tmp_path):
    cfg = composed("pe/tiny_pe_smoke", tmp_path, "tracks.ar.algorithm={_target_: unirl.algorithms.sft.LMSFT}")
    with pytest.raises(ConfigError, match=r"tracks.ar.algorithm: LMSFT is a supervised loss; a composed run"):
        validate_recipe(cfg)


def test_demonstrations_are_checked_against_the_rows_and_the_model(tmp_path):
    flow = "diffusion/shapes_sft_smoke"
    validate_recipe(composed(flow, tmp_path))

    def found(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_recipe(composed(flow, tmp_path, *overrides))
        return str(info.value)

    assert (
        "rollout.target_key='img': 165 of the 165 examples of data_source have no metadata key 'img'"
        in found("rollout.target_key=img")
    )
    assert (
        "row 'shapes/single/a_red_circle' has a [16, 16, 3] image under metadata['image'], but the track samples "
        "sampling.height x width = 32 x 32"
    ) in found("data_source.size=16")
    assert "model.tiny.pixel_space=false: a demonstration image enters a supervised track" in found(
        "model.tiny.pixel_space=false"
    )
    text = problems(tmp_path, "rollout.target_key=completion")
    assert "rollout.target_key='completion'" in text and "their metadata keys are ['answer', 'digits'" in text


OFFLINE_DPO = "diffusion/shapes_diffusiondpo_offline_smoke"


def test_an_offline_preference_track_pairs_a_group_loss_with_a_group_of_demonstrations(tmp_path):
    """DiffusionDPO may train on replayed demonstrations when a row names one per sample of its group
    (`[chosen, rejected]`); a single key, a group of another size, a supervised loss on a group, or a
    row without one of the keys are refused naming the key."""
    for name in (OFFLINE_DPO, "diffusion/shapes_diffusiondpo_offline"):
        validate_recipe(composed(name, tmp_path), expect="diffusion")

    def refused(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_recipe(composed(OFFLINE_DPO, tmp_path, *overrides), expect="diffusion")
        return str(info.value)

    assert "or for a preference loss that compares a group's samples (DiffusionDPO) name a row's" in refused(
        "rollout.target_key=chosen", "sampling.samples_per_prompt=1"
    )
    assert (
        "sampling.samples_per_prompt=3: a row's group is its 2 demonstrations (rollout.target_key=['chosen', "
        "'rejected']); set it to 2" in refused("sampling.samples_per_prompt=3")
    )
    flow_sft = [
        "algorithm={_target_: unirl.algorithms.sft.FlowSFT, config: {_target_: unirl.algorithms.sft.FlowSFTConfig}}",
        "reward=null",
        "advantage=null",
    ]
    found = refused(*flow_sft)
    assert "rollout.target_key=['chosen', 'rejected']: FlowSFT learns from one demonstration a row" in found
    assert "rollout.target_key is an empty list" in refused("rollout.target_key=[]")
    assert "rollout.target_key" in refused("rollout.target_key=[chosen,missing]") and "missing" in refused(
        "rollout.target_key=[chosen,missing]"
    )


def test_the_track_recipes_of_every_committed_base_validate(tmp_path):
    for name in (
        "diffusion/shapes_sft",
        "diffusion/ocr_sft",
        "diffusion/squares_wan_sft",
        "diffusion/shapes_edit_sft",
    ):
        validate_recipe(composed(name, tmp_path), expect="diffusion")
    for name in ("llm/shapes_pe_sft",):
        validate_recipe(composed(name, tmp_path), expect="text")


def test_a_clip_demonstration_is_checked_against_the_frames(tmp_path):
    """A video family's demonstration is an [F, H, W, 3] clip of its `model.num_frames`."""
    name = "diffusion/squares_wan_sft"
    with pytest.raises(ConfigError) as info:
        validate_recipe(composed(name, tmp_path, "data_source.sampler.num_frames=3", "data_source.rows=4"))
    assert (
        "data_source: row 'squares/0' has a [3, 16, 16, 3] clip under metadata['video'], but the track samples "
        "model.num_frames=5 frames of sampling.height x width = 16 x 16; give [5, 16, 16, 3] clips"
    ) in str(info.value)


def test_export_dir_needs_a_base_and_a_dtype(tmp_path):
    found = problems(tmp_path, "+export_dir=out", "+checkpoint.save_base_model=false", "+export_dtype=int8")
    assert "export_dtype must be one of ['float32', 'bfloat16', 'float16'], got 'int8'" in found
    assert "export_dir is empty; give the directory" in problems(tmp_path, "+export_dir=''")
    with pytest.raises(ConfigError) as info:
        validate_recipe(
            composed(SFT, tmp_path, "+export_dir=out", "+checkpoint.save_base_model=false"), expect="text"
        )
    assert (
        "export_dir='out' writes the trained model onto its base, but checkpoint.save_base_model=false leaves a "
        "random model's base unwritten"
    ) in str(info.value)


def test_a_training_guidance_scale_the_model_cannot_take_is_refused(tmp_path):
    """FlowSFT's `algorithm.config.guidance_scale` against the model: the edit base's FLUX has no
    guidance embedding, so it takes none."""
    cfg = composed("diffusion/shapes_edit_sft", tmp_path, "algorithm.config.guidance_scale=3.5")
    with pytest.raises(
        ConfigError, match=r"algorithm.config.guidance_scale=3.5: this FLUX model has no guidance"
    ):
        validate_recipe(cfg)
