"""Rules of PPO's critic against the rest of the recipe, and of PPO mini-batches.

A `critic` is needed exactly when the algorithm trains on values (`uses_values`: PPO) and
whenever `advantage.estimator` is gae; it runs on the policy's trainside workers (a dedicated
engine's rollouts carry no values), on the modality its value model values; its warm-up leaves the policy steps to train; its
LoRA targets and FSDP blocks exist in its network. `train.stack.num_mini_batches` splits the
per-rank micro-batches evenly and, above 1, needs an algorithm that takes several updates.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def check_critic(
    cfg: DictConfig, passed: dict[str, Any], algorithm: type | None, modality: str | None, problems: list[str]
) -> None:
    """The critic vs the algorithm, the advantage estimator, the run's length, the rollout
    engine, the modality and its own module tree."""
    has_critic = cfg.get("critic") is not None
    name = algorithm.__name__ if algorithm is not None else None
    uses_values = bool(getattr(algorithm, "uses_values", False))
    if algorithm is not None and uses_values and not has_critic:
        problems.append(
            f"algorithm: {name} trains on a critic's values, but the recipe has no critic; add a critic "
            "section (see examples/llm/tiny_lm_ppo.yaml)"
        )
    if algorithm is not None and has_critic and not uses_values:
        problems.append(
            f"critic: {name} ignores a critic's values; remove the critic section or use "
            "unirl.algorithms.ppo.PPO (text) or unirl.algorithms.flow_ppo.FlowPPO (diffusion)"
        )
    advantage = passed.get("advantage")
    if advantage is not None and advantage.estimator == "gae" and not has_critic:
        problems.append(
            "advantage.estimator=gae computes advantages from a critic's values, but the recipe has no "
            "critic; add a critic section or use another estimator"
        )
    if not has_critic:
        return
    critic, run = passed.get("critic"), passed.get("")
    model = passed.get("critic.model")
    if model is not None and not hasattr(model, "build_value_stage"):
        problems.append(
            f"critic.model: {type(model).__name__} is not a value-model config; use the policy family's "
            "(unirl.models.qwen.QwenValueConfig, unirl.models.flow.value.FlowValueConfig)"
        )
        return
    value_modality = getattr(model, "modality", None) if model is not None else None
    if critic is not None and run is not None and critic.warmup_steps >= run.num_steps:
        problems.append(
            f"critic.warmup_steps={critic.warmup_steps} must be < num_steps={run.num_steps}: the policy "
            "is frozen during the warm-up, so it would never train"
        )
    if modality is not None and value_modality is not None and modality != value_modality:
        problems.append(
            f"critic.model: {type(model).__name__} values {value_modality} tracks, but this is a {modality} "
            "recipe; use the policy family's value config"
        )
    from unirl.rollout.dedicated import is_dedicated

    key = "rollout" if "rollout" in cfg else "engine"  # a composed track's engine
    if isinstance(cfg.get(key), DictConfig) and is_dedicated(cfg[key]):
        problems.append(
            "critic: the train workers record the critic's values of the rollouts they sample, but "
            f"{key} names a dedicated engine; use unirl.rollout.trainside.TrainsideEngine"
        )
    if critic is None:
        return
    lora, fsdp = passed.get("critic.lora"), passed.get("critic.fsdp")
    if run is not None and run.num_devices > 1 and cfg.critic.get("fsdp") is None:
        problems.append(
            f"critic.fsdp: num_devices={run.num_devices} needs FSDP2 settings of the critic "
            "(e.g. {_target_: unirl.train.fsdp.FSDPConfig})"
        )
    from unirl.config.distributed import check_module_tree

    check_module_tree(model, lora, fsdp, problems, section="critic", model_key="critic.model")


def check_mini_batches(cfg: DictConfig, stack: Any, algorithm: type | None, problems: list[str]) -> None:
    """A track's `train.stack.num_mini_batches` above 1: its algorithm takes several updates per
    rollout and no sampling graphs are kept (`rollout.keep_graph`, a composed track's
    `engine.keep_graph`). Whether it divides a rank's micro-batches is batch geometry
    (`mini_batch_problem`, run where the kind knows a rank's batch)."""
    if stack is None or stack.num_mini_batches == 1:
        return
    n = stack.num_mini_batches
    if algorithm is not None and not getattr(algorithm, "supports_multi_update", False):
        problems.append(
            f"train.stack.num_mini_batches={n}: {algorithm.__name__} does not support several updates "
            "per rollout; set it to 1"
        )
    key = "rollout" if "rollout" in cfg else "engine"
    rollout = cfg.get(key)
    if isinstance(rollout, DictConfig) and rollout.get("keep_graph", False):
        problems.append(
            f"{key}.keep_graph: a kept graph is valid for the first optimizer step only, but "
            f"train.stack.num_mini_batches={n}; set it to 1 or {key}.keep_graph=false"
        )


def mini_batch_problem(stack: Any, per_rank: int, key: str = "train.stack") -> str | None:
    """`{key}.num_mini_batches` vs the micro-batches of a rank's batch of `per_rank` samples: it must
    divide them; None when it does (or is 1)."""
    if stack is None or stack.num_mini_batches == 1:
        return None
    micro = per_rank // stack.micro_batch_size
    if micro % stack.num_mini_batches:
        return (
            f"{key}.num_mini_batches={stack.num_mini_batches} does not divide the {micro} micro-batches of a "
            f"rank (per-rank batch {per_rank} / micro_batch_size {stack.micro_batch_size})"
        )
    return None
