"""Validation of a recipe, run before any Ray work: the entry points call it.

Two phases, both reporting every problem they find:

1. Every node is type- and range-checked on its own (`unirl.config.tree.check_recipe`): the
   top level and the plain sections against their schemas (`unirl.config.run`), every
   `_target_` node against its target, and each target that can be built from the recipe
   alone is built, so its constructor's own checks run too.
2. Cross-component rules run on whatever phase 1 built: the rules of the one track
   (`track.check_track`, shared with every track of a composed recipe), then the run's own; one
   module per concern: the modality
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

from unirl.config.critic import check_mini_batches
from unirl.config.distributed import check_distributed, check_this_machine, check_transport
from unirl.config.engines import check_rollout
from unirl.config.geometry import check_training_guidance
from unirl.config.modality import check_eval_sampling, check_modality
from unirl.config.references import check_conditions, check_model_path, check_prompt_keys, check_tracking
from unirl.config.run import RL_SECTIONS, SFT_SECTIONS
from unirl.config.supervised import check_demonstrations
from unirl.config.track import check_track
from unirl.config.tree import ConfigError, check_recipe, target_class

__all__ = ["ConfigError", "validate_rl_config", "validate_sft_config"]


def validate_rl_config(cfg: DictConfig, expect: str | None = None, on_this_machine: bool = True) -> None:
    """Raise `ConfigError` listing every problem of an RL recipe (diffusion or text).

    Args:
        expect: the modality the entry point runs ("diffusion" or "text"); a
            recipe of the other modality is a problem naming the right entry point.
        on_this_machine: the run starts here, so what this machine must have is checked too
            (`check_this_machine`); False for a recipe planned for other machines
            (`unirl.plan_memory`).
    """
    problems: list[str] = []
    passed = check_recipe(cfg, RL_SECTIONS, problems)
    check_transport(cfg, problems)
    model, sampling = passed.get("model"), passed.get("sampling")
    algorithm = target_class(cfg, "algorithm") if "algorithm" in cfg else None
    modality = check_modality(cfg, sampling, model, algorithm, expect, problems)
    # the recipe is one track at the root: its batch is the run's, its evaluation the run's
    check_track(
        cfg,
        passed,
        modality,
        problems,
        run=passed.get(""),
        eval_sampling=passed.get("eval.sampling"),
        ev=passed.get("eval"),
    )
    check_eval_sampling(cfg, modality, problems)
    check_mini_batches(cfg, passed, algorithm, problems)
    check_distributed(cfg, passed, problems)
    if on_this_machine:
        check_this_machine(cfg, passed, problems)
    check_rollout(cfg, passed, problems)
    check_prompt_keys(passed, problems)
    check_demonstrations(cfg, passed, problems)
    check_conditions(passed, problems)
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
