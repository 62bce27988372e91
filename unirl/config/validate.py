"""Validation of a recipe, run before any Ray work: the entry points call it.

Two phases, both reporting every problem they find:

1. Every node is type- and range-checked on its own (`unirl.config.tree.check_recipe`): the
   top level and the plain sections against their schemas (`unirl.config.run`), every
   `_target_` node against its target, and each target that can be built from the recipe
   alone is built, so its constructor's own checks run too.
2. Cross-component rules run on whatever phase 1 built, one module per concern: the modality
   (`modality`), batch and image geometry (`geometry`), the algorithm vs sampling, updates,
   EMA, SDE, kept graphs and advantages (`algorithm`), PPO's critic and mini-batches
   (`critic`), a distillation recipe's teachers and its reward-free training (`distill`), devices,
   FSDP, LoRA, transport and
   resume (`distributed`), the rollout engine and weight sync (`engines`), and the paths and
   names a recipe refers to (`references`). A rule is skipped only when one of its inputs
   failed phase 1.

Every problem names the recipe keys involved and says what is expected; all of them are
reported together in one `ConfigError`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from unirl.config.algorithm import (
    check_advantage,
    check_algorithm,
    check_ema_use,
    check_keep_graph,
    check_reward_backprop,
    check_sde,
)
from unirl.config.critic import check_critic, check_mini_batches
from unirl.config.distill import check_distillation
from unirl.config.distributed import check_distributed, check_transport
from unirl.config.engines import check_rollout
from unirl.config.geometry import check_eval_size, check_geometry, check_guidance, check_training_guidance
from unirl.config.modality import check_eval_sampling, check_modality, check_text
from unirl.config.references import check_model_path, check_prompt_keys, check_tracking
from unirl.config.run import RL_SECTIONS, SFT_SECTIONS
from unirl.config.tree import ConfigError, check_recipe, target_class

__all__ = ["ConfigError", "validate_rl_config", "validate_sft_config"]


def validate_rl_config(cfg: DictConfig, expect: str | None = None) -> None:
    """Raise `ConfigError` listing every problem of an RL recipe (diffusion or text).

    Args:
        expect: the modality the entry point runs ("diffusion" or "text"); a
            recipe of the other modality is a problem naming the right entry point.
    """
    problems: list[str] = []
    passed = check_recipe(cfg, RL_SECTIONS, problems)
    check_transport(cfg, problems)
    model = passed.get("model")
    check_model_path(model, problems)
    sampling, stack = passed.get("sampling"), passed.get("train.stack")
    algorithm = target_class(cfg, "algorithm") if "algorithm" in cfg else None
    modality = check_modality(cfg, sampling, model, algorithm, expect, problems)
    check_geometry(passed.get(""), sampling, stack, model, problems)
    check_guidance(model, sampling, passed.get("eval.sampling"), problems)
    check_eval_size(model, sampling, passed.get("eval.sampling"), problems)
    if modality == "text":
        check_text(cfg, sampling, model, problems, passed.get("eval.sampling"))
    check_eval_sampling(cfg, modality, problems)
    check_algorithm(algorithm, sampling, stack, passed.get("train"), passed.get("eval"), problems)
    check_ema_use(passed.get("algorithm"), passed.get("train"), problems)
    check_keep_graph(cfg, passed, modality, problems)
    if modality == "diffusion":
        check_sde(cfg, sampling, problems)
    check_reward_backprop(cfg, algorithm, passed.get("algorithm"), sampling, problems)
    check_distillation(cfg, passed, algorithm, sampling, problems)
    check_advantage(passed.get("algorithm"), passed.get("advantage"), sampling, modality, problems)
    check_critic(cfg, passed, algorithm, modality, problems)
    check_mini_batches(cfg, passed, algorithm, problems)
    check_distributed(cfg, passed, problems)
    check_rollout(cfg, passed, problems)
    check_prompt_keys(passed, problems)
    check_tracking(cfg, problems)
    if problems:
        raise ConfigError(problems)


def validate_sft_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every problem of a supervised (`unirl.train_sft`) recipe."""
    problems: list[str] = []
    passed = check_recipe(cfg, SFT_SECTIONS, problems)
    check_model_path(passed.get("model"), problems)
    check_training_guidance(passed.get("model"), passed.get("sft"), problems)
    check_tracking(cfg, problems)
    if problems:
        raise ConfigError(problems)
