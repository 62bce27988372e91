"""A unified recipe's bad input is refused before Ray, every problem naming its key."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES
from unirl.config.validate import ConfigError, validate_recipe

FREEZE_PLAN = ["tracks.plan.trained=false", "~tracks.plan.algorithm", "~tracks.plan.advantage"]
FREEZE_IMAGE = ["tracks.image.trained=false", "~tracks.image.algorithm", "~tracks.image.advantage"]


FSDP = "train.fsdp={_target_: unirl.train.fsdp.FSDPConfig, block_classes: [LlamaDecoderLayer]}"


def recipe(*overrides: str):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose("unified/tiny_bicot_smoke", overrides=list(overrides))


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe(*overrides))
    return info.value.problems


@pytest.mark.parametrize(
    "name",
    sorted(
        os.path.splitext(f)[0] for f in os.listdir(os.path.join(EXAMPLES, "unified")) if f.endswith(".yaml")
    ),
)
def test_every_unified_recipe_is_valid(name: str) -> None:
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        validate_recipe(compose(f"unified/{name}"))


def dedicated(*overrides: str):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose("unified/tiny_bicot_dedicated", overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["+rollout.max_staleness=1"],
            "rollout.max_staleness=1: a unified engine samples the weights of the step",
        ),
        (
            ["+rollout.overlap_reward=true"],
            "rollout.overlap_reward=true: a unified engine returns a rollout whole",
        ),
        (["launcher=in_process", "transport=inband"], "a dedicated rollout engine is a Ray actor"),
        (
            ["rollout.num_engines=3", "rollout.placement=separate", "rollout.sleep_level=0"],
            "do not split evenly over rollout.num_engines=3",
        ),
        (["~weight_sync"], "weight_sync"),
        (
            [
                "rollout._target_=unirl.rollout.trainside.TrainsideEngine",
                "~rollout.tracks",
                "~rollout.placement",
                "~rollout.num_engines",
                "~rollout.sleep_level",
            ],
            "is not a unified engine",
        ),
    ],
)
def test_a_dedicated_engine_s_bad_input_names_its_key(overrides, expected) -> None:
    with pytest.raises(ConfigError) as err:
        validate_recipe(dedicated(*overrides))
    assert expected in str(err.value)


def test_a_trainside_recipe_with_a_weight_sync_is_refused() -> None:
    found = problems("+weight_sync={backend: object_store}")
    assert any("weight_sync" in p for p in found), found


def test_two_ranks_with_fsdp_are_valid() -> None:
    validate_recipe(recipe("num_devices=2", "launcher=ray", FSDP))


def test_each_ablation_is_one_segment_frozen() -> None:
    validate_recipe(recipe(*FREEZE_PLAN))
    validate_recipe(recipe(*FREEZE_IMAGE))


def test_both_segments_frozen_names_both_keys() -> None:
    (p,) = problems(*FREEZE_PLAN, *FREEZE_IMAGE)
    assert "tracks.plan.trained and tracks.image.trained are both false" in p


def test_all_segment_weights_zero_names_the_keys() -> None:
    (p,) = problems("tracks.plan.weight=0", "tracks.image.weight=0")
    assert p.startswith("tracks.plan.weight and tracks.image.weight: the segment weights") and "all 0" in p
    (p,) = problems("tracks.plan.weight=0")
    assert p.startswith("tracks.plan.weight is 0 but tracks.plan.trained is true")
    assert "weight must be >= 0" in " ".join(problems("tracks.image.weight=-1"))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["++tracks.image.sampling.samples_per_prompt=2"],
            "tracks.image.sampling.samples_per_prompt=2: a unified run",
        ),
        (["tracks.plan.sampling.stop_tokens=[END]"], "tracks.plan.sampling.stop_tokens: 'END' is 3 tokens"),
        (
            ["tracks.plan.sampling.max_new_tokens=100"],
            "tracks.plan.sampling.max_prompt_length (64) + max_new_tokens",
        ),
        (["tracks.plan.trained=false"], "tracks.plan: track 'plan' is frozen (trained: false) but sets"),
        (["~tracks.image.advantage"], "tracks.image.advantage: track 'image' is trained"),
        (
            ["num_devices=2", "launcher=ray"],
            "train.fsdp: num_devices=2 needs FSDP2 settings for the backbone",
        ),
        (
            ["num_devices=3", "launcher=ray", FSDP],
            "= 8 samples do not split evenly over num_devices=3",
        ),
        (
            ["num_devices=2", "launcher=ray", FSDP, "train.stack.micro_batch_size=8"],
            "train.stack.micro_batch_size=8 does not divide each rank's batch of 4",
        ),
        (
            [FSDP.replace("LlamaDecoderLayer", "JointTransformerBlock")],
            "train.fsdp.block_classes ['JointTransformerBlock'] match no module",
        ),
        (
            ["train.stack.micro_batch_size=3"],
            "train.stack.micro_batch_size=3 does not divide each rank's batch of 8",
        ),
        (["~rewards.image"], "rewards.image: the image track needs a reward"),
        (
            ["tracks.image.stage._target_=unirl.models.causal_lm.CausalLMStage"],
            "tracks.image.stage: unirl.models.causal_lm.CausalLMStage is not an image-token stage",
        ),
        (
            [
                "tracks.image.algorithm._target_=unirl.algorithms.flow_grpo.FlowGRPO",
                "~tracks.image.algorithm.config",
            ],
            "tracks.image.algorithm: unirl.algorithms.flow_grpo.FlowGRPO is a diffusion algorithm",
        ),
        (
            [
                "model._target_=unirl.models.qwen.QwenConfig",
                "~model.tiny",
                "+model.tiny={hidden_size: 32}",
            ],
            "model: unirl.models.qwen.QwenConfig is not a unified model",
        ),
    ],
)
def test_bad_input_names_its_key(overrides, expected) -> None:
    found = problems(*overrides)
    assert any(expected in p for p in found), found


def test_every_leaf_of_the_smoke_recipe_rejects_bad_values_with_its_full_key() -> None:
    """As tests/config/test_validate.py does for the single-track recipes: every scalar leaf of
    unified/tiny_bicot_smoke set to a wrong type (and -1 where it has a range) is refused, and
    the problem names its key."""
    from omegaconf import OmegaConf

    from tests.config.test_validate import leaves, mutations

    tree = OmegaConf.to_container(recipe(), resolve=True)
    checked = 0
    for key, container, index, good in list(leaves(tree)):
        node_path, _, leaf = key.rpartition(".")
        for bad in mutations(good, key):
            if ".backend.weights." in key and bad == -1.0:
                continue  # a negative reward weight flips a reward on purpose
            container[index] = bad
            with pytest.raises(ConfigError) as info:
                validate_recipe(OmegaConf.create(tree))
            container[index] = good
            lines = [line for line in str(info.value).splitlines() if repr(bad) in line or str(bad) in line]
            assert any(
                key in line or key.split("[")[0] in line or (node_path in line and leaf.split("[")[0] in line)
                for line in lines
            ), f"{key}={bad!r} not named:\n{info.value}"
            checked += 1
    assert checked > 60


def test_dynamic_sampling_on_a_segment_is_refused() -> None:
    (p,) = problems(
        "tracks.plan.algorithm._target_=unirl.algorithms.dapo.DAPO",
        "tracks.plan.algorithm.config._target_=unirl.algorithms.dapo.DAPOConfig",
    )
    assert p.startswith("tracks.plan.algorithm.config.dynamic_sampling=true: DAPO") and "false" in p


def test_every_one_track_rule_runs_on_each_segment() -> None:
    """The one validator walks a unified recipe's segments as tracks sharing the root's `model`
    and `train`: a rule the unified validator once skipped (the advantage vs its group) names the
    segment's key, and an image's group is its prompt's plans (one image each), not its own
    samples_per_prompt of 1."""
    assert validate_recipe(recipe("tracks.image.advantage.estimator=rloo")) is None  # 4 plans: siblings
    found = problems(
        "tracks.plan.sampling.samples_per_prompt=1",
        "tracks.plan.advantage.estimator=rloo",
        "tracks.image.advantage.estimator=rloo",
    )
    rloo = "advantage.estimator=rloo compares each sample with its siblings: "
    assert f"tracks.plan.{rloo}sampling.samples_per_prompt must be >= 2, got 1" in found, found
    assert f"tracks.image.{rloo}tracks.plan.sampling.samples_per_prompt must be >= 2, got 1" in found, found
    # a problem of the shared backbone is named once, at the root, though both segments read it
    found = problems("model.pretrained_path=/nonexistent/janus", "~model.tiny")
    assert sum(p.startswith("model.pretrained_path") for p in found) == 1, found
