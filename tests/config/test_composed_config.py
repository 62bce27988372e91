"""A composed recipe's bad input is refused before Ray, every problem naming its key."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES
from unirl.config.validate import ConfigError, validate_recipe


def recipe(*overrides: str):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose("pe/tiny_pe_smoke", overrides=list(overrides))


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe(*overrides))
    return info.value.problems


@pytest.mark.parametrize(
    "name",
    sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(EXAMPLES, "pe")) if f.endswith(".yaml")),
)
def test_every_pe_recipe_is_valid(name: str) -> None:
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        validate_recipe(compose(f"pe/{name}"))


def test_smoke_recipe_is_valid() -> None:
    validate_recipe(recipe())
    validate_recipe(
        recipe(
            "tracks.diffusion.trained=false",
            "~tracks.diffusion.algorithm",
            "~tracks.diffusion.advantage",
            "~tracks.diffusion.train",
        )
    )


def test_tracks_that_disagree() -> None:
    (p,) = problems("rollout.tracks=[ar,image]")
    assert "rollout.tracks ['ar', 'image']" in p and "['ar', 'diffusion']" in p


def test_a_chain_that_visits_a_track_twice() -> None:
    """A cycle (the enhancer feeding the diffusion model feeding the enhancer) is a chain naming a
    track twice: the engine refuses it before Ray, naming the key and the value."""
    assert any(
        "rollout.tracks must name two or more distinct tracks, root first, got ['ar', 'diffusion', 'ar']" in p
        for p in problems("rollout.tracks=[ar,diffusion,ar]")
    )


def test_trained_track_without_algorithm() -> None:
    found = problems("~tracks.ar.algorithm")
    assert any(p.startswith("tracks.ar.algorithm:") and "exactly one algorithm" in p for p in found)


def test_frozen_track_with_an_optimizer() -> None:
    found = problems("tracks.diffusion.trained=false")
    assert any(p.startswith("tracks.diffusion:") and "frozen" in p and "train" in p for p in found)


def test_unknown_aggregate() -> None:
    found = problems("tracks.ar.aggregate=median")
    assert any("tracks.ar" in p and "aggregate" in p and "median" in p for p in found)


def test_reward_for_a_track_that_does_not_exist() -> None:
    found = problems("+rewards.critic=${rewards.diffusion}")
    assert any(p.startswith("rewards.critic:") and "does not exist" in p for p in found)


def test_leaf_without_reward() -> None:
    found = problems("~rewards.diffusion", "+rewards.ar=${tracks.ar.advantage}")
    assert any(p.startswith("rewards.diffusion:") and "leaf" in p for p in found)


def test_algorithm_of_the_wrong_modality() -> None:
    found = problems("tracks.ar.algorithm=${tracks.diffusion.algorithm}")
    assert any(p.startswith("tracks.ar.algorithm:") and "diffusion algorithm" in p for p in found)


def test_root_must_be_text_and_geometry_per_track() -> None:
    found = problems("rollout.tracks=[diffusion,ar]")
    assert any(p.startswith("tracks.diffusion.sampling:") and "text track" in p for p in found)
    found = problems("num_devices=2", "prompts_per_rollout=1", "tracks.ar.sampling.samples_per_prompt=1")
    assert any("do not split evenly over num_devices=2" in p for p in found)
    found = problems("tracks.diffusion.train.stack.micro_batch_size=3")
    assert any(p.startswith("tracks.diffusion.train.stack.micro_batch_size=3") for p in found)


def test_single_track_rules_apply_per_track() -> None:
    found = problems("tracks.diffusion.sampling.eta=0")
    assert any(p.startswith("tracks.diffusion.sampling.eta=0") for p in found)
    found = problems("tracks.ar.sampling.max_new_tokens=60")
    assert any(p.startswith("tracks.ar.sampling.max_prompt_length") for p in found)


def test_lora_targets_that_match_nothing() -> None:
    found = problems("tracks.diffusion.train.lora.target_modules=[nope]")
    assert any(
        p.startswith("tracks.diffusion.train.lora.target_modules ['nope'] match no module") and "to_q" in p
        for p in found
    )


def test_a_tracks_model_path_and_stop_tokens_are_checked() -> None:
    (p,) = problems("+tracks.ar.sampling.stop_tokens=[nope_tok]")
    assert p.startswith("tracks.ar.sampling.stop_tokens: 'nope_tok' is 8 tokens")
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose("pe/shapes_pe_grpo", overrides=["tracks.ar.model.pretrained_path=/no/such/lm"])
    with pytest.raises(ConfigError) as info:
        validate_recipe(cfg)
    assert any(
        p.startswith("tracks.ar.model.pretrained_path: '/no/such/lm' is not a directory")
        for p in info.value.problems
    )


def test_metadata_keys_the_prompts_lack() -> None:
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            "pe/shapes_pe_grpo",
            overrides=[
                "eval.group_by=[nope1]",
                "eval.intent_key=nope2",
                "rewards.diffusion.backend.components.geneval.intent_key=nope3",
                "+eval.rewrite_scorer.canonical_key=nope4",
            ],
        )
    with pytest.raises(ConfigError) as info:
        validate_recipe(cfg)
    for key, value in [
        ("eval.group_by", "nope1"),
        ("eval.intent_key", "nope2"),
        ("rewards.diffusion.backend.components.geneval.intent_key", "nope3"),
        ("eval.rewrite_scorer.canonical_key", "nope4"),
    ]:
        (p,) = [p for p in info.value.problems if p.startswith(f"{key}={value!r}:")]
        assert "no metadata key" in p and "'canonical'" in p


FLUX_TRACK = [
    "tracks.diffusion.model._target_=unirl.models.flux.FluxModelConfig",
    "tracks.diffusion.stage._target_=unirl.models.flux.FluxStage",
    "tracks.diffusion.train.fsdp.block_classes=[FluxTransformerBlock]",
    "~tracks.diffusion.model.tiny",
    "+tracks.diffusion.model.tiny={resolution: 16, pixel_space: true, num_layers: 1, num_single_layers: 1, "
    "attention_head_dim: 16, num_attention_heads: 2, guidance_embeds: false}",
]


def test_every_single_track_rule_runs_on_every_track() -> None:
    """The rules the composed validator once skipped (issue 41), each named under the track's key:
    guidance the model refuses, an advantage that needs siblings, an algorithm that needs an
    EMA, a critic the recipe lacks, a reward-backprop algorithm without its trajectory."""
    assert validate_recipe(recipe(*FLUX_TRACK)) is None  # FLUX, guidance 1.0: fine
    found = problems(*FLUX_TRACK, "tracks.diffusion.sampling.guidance_scale=4.0")
    assert any(
        p.startswith("tracks.diffusion.sampling.guidance_scale=4.0: this FLUX model has no guidance embedding")
        for p in found
    ), found
    found = problems("tracks.ar.advantage.estimator=rloo", "tracks.ar.sampling.samples_per_prompt=1")
    assert any(p.startswith("tracks.ar.advantage.estimator=rloo compares each sample with its siblings") for p in found)
    found = problems(
        "tracks.diffusion.algorithm._target_=unirl.algorithms.awm.AWM",
        "tracks.diffusion.algorithm.config._target_=unirl.algorithms.awm.AWMConfig",
        "~tracks.diffusion.algorithm.config.old_logp_source",
        "+tracks.diffusion.algorithm.config.ema_kl_beta=0.1",
    )
    assert any(p.startswith("tracks.diffusion.algorithm: AWM measures a KL to the EMA") for p in found), found
    found = problems("tracks.ar.advantage.estimator=gae")
    assert any(p.startswith("tracks.ar.advantage.estimator=gae computes advantages from a critic's values") for p in found)


def ppo_problems(*overrides: str) -> list[str]:
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose("pe/tiny_pe_ppo", overrides=list(overrides))
    with pytest.raises(ConfigError) as info:
        validate_recipe(cfg)
    return info.value.problems


def test_a_tracks_critic_is_checked_under_its_own_keys() -> None:
    """`tracks.<name>.critic` (pe/tiny_pe_ppo): PPO without it, a critic beside an algorithm that
    ignores it, one that warms up for the whole run, one on a dedicated engine or on more devices
    without FSDP, and one on a frozen track are refused, each naming the track's key."""
    found = ppo_problems("~tracks.ar.critic")
    assert any(p.startswith("tracks.ar.algorithm: PPO trains on a critic's values") for p in found), found
    found = ppo_problems("tracks.ar.critic.warmup_steps=2")
    assert any(p.startswith("tracks.ar.critic.warmup_steps=2 must be < num_steps=2") for p in found), found
    found = ppo_problems("tracks.diffusion.algorithm._target_=unirl.algorithms.flow_grpo.FlowGRPO",
                         "tracks.diffusion.algorithm.config._target_=unirl.algorithms.flow_grpo.FlowGRPOConfig",
                         "tracks.diffusion.advantage.estimator=grpo")  # fmt: skip
    assert any(p.startswith("tracks.diffusion.critic: FlowGRPO ignores a critic's values") for p in found), found
    found = ppo_problems("num_devices=2")  # the diffusion critic has no fsdp node
    assert any(p.startswith("tracks.diffusion.critic.fsdp: num_devices=2 needs FSDP2 settings") for p in found), found
    found = ppo_problems(
        "+tracks.ar.engine={_target_: unirl.rollout.dedicated.DedicatedEngine, placement: colocate}",
        "+tracks.ar.weight_sync={_target_: unirl.sync.WeightSyncConfig}",
    )
    assert any(p.startswith("tracks.ar.critic: the train workers record the critic's values") for p in found), found
    found = ppo_problems("tracks.ar.trained=false", "~tracks.ar.algorithm", "~tracks.ar.advantage", "~tracks.ar.train")
    assert any(p.startswith("tracks.ar: track 'ar' is frozen (trained: false) but sets ['critic']") for p in found)


def test_a_tracks_mini_batches_are_checked_against_its_own_batch() -> None:
    """`tracks.<name>.train.stack.num_mini_batches` divides the micro-batches of the track's
    per-rank batch (the diffusion track's: 2 prompts x 2 rewrites x 2 images = 8, in 2
    micro-batches of 4), as a single track's does."""
    assert validate_recipe(recipe("+tracks.diffusion.train.stack.num_mini_batches=2")) is None
    found = problems("+tracks.diffusion.train.stack.num_mini_batches=3")
    assert found == [
        "tracks.diffusion.train.stack.num_mini_batches=3 does not divide the 2 micro-batches of a rank "
        "(per-rank batch 8 / micro_batch_size 4)"
    ], found


def test_a_frozen_track_is_checked_as_a_model_only() -> None:
    found = problems("tracks.diffusion.trained=false", "~tracks.diffusion.algorithm", "~tracks.diffusion.advantage",
                     "~tracks.diffusion.train", *FLUX_TRACK[:2], *FLUX_TRACK[3:],
                     "tracks.diffusion.sampling.guidance_scale=4.0")  # fmt: skip
    assert any(p.startswith("tracks.diffusion.sampling.guidance_scale=4.0") for p in found), found


def dedicated_problems(*overrides: str) -> list[str]:
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose("pe/tiny_pe_dedicated", overrides=list(overrides))
    with pytest.raises(ConfigError) as info:
        validate_recipe(cfg)
    return info.value.problems


def test_a_tracks_engine_gets_the_engine_rules_under_its_own_keys() -> None:
    """`tracks.<name>.engine` is checked as a single-track `rollout` is (devices, sleep level,
    sync backend, Ray, the split of the track's batch), every problem naming the track's keys."""
    (p,) = dedicated_problems("tracks.ar.engine.num_engines=2")
    assert p.startswith("tracks.ar.engine.num_engines=2 with tracks.ar.engine.placement=colocate") and "num_devices=1" in p
    (p,) = dedicated_problems("tracks.ar.engine.placement=separate")
    assert p.startswith("tracks.ar.engine.sleep_level=2") and "set tracks.ar.engine.sleep_level=0" in p
    (p,) = dedicated_problems("~tracks.ar.weight_sync")
    assert p.startswith("tracks.ar.weight_sync:") and "one sync backend" in p
    (p,) = dedicated_problems("++launcher=in_process", "transport=inband")
    assert "launcher=in_process" in p and "Ray actor" in p
    # the enhancer's batch: 3 prompts x 2 rewrites = 6 samples over 4 separate engines
    found = dedicated_problems(
        "prompts_per_rollout=3", "tracks.ar.engine.num_engines=4", "tracks.ar.engine.placement=separate",
        "tracks.ar.engine.sleep_level=0",
    )
    assert any("do not split evenly over tracks.ar.engine.num_engines=4" in p for p in found)


def test_what_a_composed_tracks_engine_cannot_do() -> None:
    """Staleness and reward overlap belong to single-track runs (a chain is walked and scored within
    the step); a frozen track's engine would never receive weights; a sync needs an engine; vLLM's
    head sizes are checked on the track's model."""
    found = dedicated_problems("+tracks.ar.engine.max_staleness=1")
    assert any(p.startswith("tracks.ar.engine.max_staleness=1: a composed run") for p in found)
    (p,) = dedicated_problems("+tracks.ar.engine.overlap_reward=true")
    assert p.startswith("tracks.ar.engine.overlap_reward=true") and "remove it" in p
    (p,) = dedicated_problems("+tracks.diffusion.weight_sync.backend=object_store")
    assert p.startswith("tracks.diffusion.weight_sync:") and "trainside" in p
    found = dedicated_problems(
        "tracks.ar.trained=false", "~tracks.ar.algorithm", "~tracks.ar.advantage", "~tracks.ar.train"
    )
    assert any(p.startswith("tracks.ar.engine: track 'ar' is frozen") for p in found)
    (p,) = dedicated_problems("tracks.ar.engine._target_=unirl.rollout.vllm.VLLMEngine")
    assert p.startswith("tracks.ar.model.tiny: head size 16") and "32" in p


def test_dynamic_sampling_on_a_chained_track_is_refused() -> None:
    """DAPO's dynamic sampling draws more prompts until enough groups differ: a chained track
    trains on what its parent made, so the recipe is refused naming the track's key."""
    dapo = [
        "tracks.ar.algorithm._target_=unirl.algorithms.dapo.DAPO",
        "tracks.ar.algorithm.config._target_=unirl.algorithms.dapo.DAPOConfig",
    ]
    found = problems(*dapo)
    assert any(p.startswith("tracks.ar.algorithm.config.dynamic_sampling=true: DAPO") for p in found)
    validate_recipe(recipe(*dapo, "+tracks.ar.algorithm.config.dynamic_sampling=false"))


def test_one_eval_config_with_a_chains_keys() -> None:
    """`eval` is one `EvalConfig` for every kind: a chain must say how its root decodes, and with
    `use_ema` every trained track must keep an EMA; a single track's eval takes none of a chain's
    keys."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        chain = compose("pe/shapes_pe_grpo", overrides=["~eval.text_sampling", "+eval.use_ema=true"])
        single = compose("llm/arith_grpo_smoke", overrides=["+eval.intent_key=canonical", "+eval.references=false"])
    with pytest.raises(ConfigError) as info:
        validate_recipe(chain)
    found = info.value.problems
    assert any(p.startswith("eval.text_sampling: missing; a chain's evaluation decodes its root") for p in found)
    ema = [p for p in found if p.startswith("eval.use_ema=true")]  # the diffusion track is frozen
    assert len(ema) == 1 and "but tracks.ar.train.ema is null" in ema[0]
    with pytest.raises(ConfigError) as info:
        validate_recipe(single)
    assert sorted(p.split(":")[0] for p in info.value.problems if "a chain's key" in p) == [
        "eval.intent_key",
        "eval.references",
    ]


def test_sequence_parallelism_on_a_track_of_a_graph_is_refused() -> None:
    """`train.parallel.sp` needs the single-track driver's sample groups: a composed track that
    sets it is refused before Ray naming its key."""
    found = problems("+tracks.diffusion.train.parallel.sp=2")
    key = "tracks.diffusion.train.parallel.sp=2: sequence parallelism runs in single-track"
    assert any(p.startswith(key) for p in found)
