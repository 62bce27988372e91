"""Recipe checks of the rollout engine, its placement and its weight sync (run before Ray).

A trainside engine samples with the trained module: no `weight_sync` block.
A dedicated engine (`unirl.rollout.dedicated.DedicatedEngine`) needs exactly
one sync backend, Ray workers, enough devices for its placement, an even
split of the batch over its engines, and for `max_staleness: 1` a separate
placement and an algorithm whose importance ratios use the log-probs the
engine recorded. Each problem names its keys and says what to set.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from unirl.rollout.dedicated import is_dedicated
from unirl.rollout.vllm.engine import ARCHITECTURES, INSTALL_HINT, VLLMEngine, head_dim_of, head_dim_problem
from unirl.sync import weight_sync_problems


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_rollout(cfg: DictConfig, passed: dict[str, Any], problems: list[str], key: str = "rollout") -> None:
    """Append the problems of the recipe's engine / placement / weight sync to `problems`.

    `passed` is `check_recipe`'s result: a check runs only when the nodes it reads passed
    their own type and range checks (their problems are already reported). `key`: what the
    problems call the engine node (a composed track's `engine`, seen as `rollout` in its view)."""
    rollout = cfg.get("rollout")
    if not isinstance(rollout, DictConfig) or "rollout" not in passed:
        return
    node = cfg.get("weight_sync")
    sync = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    dedicated = is_dedicated(rollout)
    placement = str(rollout.get("placement", "colocate"))
    if "weight_sync" in passed or sync is None:
        problems.extend(
            weight_sync_problems(sync, dedicated=dedicated, placement=placement, device_type=_device_type())
        )
    run = passed.get("")
    if not dedicated or run is None:
        return
    engines = int(rollout.get("num_engines", 1))
    staleness = int(rollout.get("max_staleness", 0))
    if run.launcher == "in_process":
        problems.append(
            "launcher=in_process runs one worker without Ray, but a dedicated rollout engine is a Ray actor; "
            "use launcher=ray (or the trainside engine)"
        )
    if placement == "colocate" and engines > run.num_devices:
        problems.append(
            f"{key}.num_engines={engines} with {key}.placement=colocate: colocated engines share the "
            f"training devices, at most num_devices={run.num_devices}; lower it or use placement=separate"
        )
    if placement == "separate":
        if int(rollout.get("sleep_level", 1)) != 0:
            problems.append(
                f"{key}.sleep_level={rollout.sleep_level} with {key}.placement=separate: separate engines "
                f"have devices of their own, nothing to release while the trainer trains; set {key}.sleep_level=0"
            )
        if _device_type() == "cuda" and not os.environ.get("RAY_ADDRESS"):
            import torch

            have, need = torch.cuda.device_count(), run.num_devices + engines
            if have < need:
                problems.append(
                    f"{key}.placement=separate needs num_devices ({run.num_devices}) + {key}.num_engines "
                    f"({engines}) = {need} GPUs, this machine has {have}; lower them or use placement=colocate"
                )
    sampling = passed.get("sampling")
    if sampling is not None and (run.prompts_per_rollout * sampling.samples_per_prompt) % engines:
        problems.append(
            f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x sampling.samples_per_prompt "
            f"({sampling.samples_per_prompt}) samples do not split evenly over {key}.num_engines={engines}"
        )
    advantage = passed.get("advantage")
    if advantage is not None and float(getattr(advantage, "kl_coef", 0) or 0) > 0:
        problems.append(
            f"advantage.kl_coef={advantage.kl_coef} folds the KL to the reference into the reward, which "
            "the trainside rollout records; a dedicated engine holds no reference policy: use the trainside "
            "engine, or a KL term in the loss (algorithm.config)"
        )
    if staleness > 0:
        if placement != "separate":
            problems.append(
                f"{key}.max_staleness={staleness} runs the next rollout while the trainer trains, which needs "
                f"the engines on devices of their own: set {key}.placement=separate (or max_staleness=0)"
            )
        algorithm = cfg.get("algorithm")
        config = algorithm.get("config") if isinstance(algorithm, DictConfig) else None
        source = config.get("old_logp_source") if isinstance(config, DictConfig) else None
        if source != "rollout":
            problems.append(
                f"{key}.max_staleness={staleness}: samples come from weights up to {staleness} versions behind, "
                "so the importance ratio must use the behaviour log-probs the engine recorded; set "
                f"algorithm.config.old_logp_source=rollout (got {source!r}"
                + (")" if source is not None else ": this algorithm has no importance ratio)")
            )
    partial = rollout.get("partial_tokens")
    if partial is not None:
        check_partial(int(partial), staleness, passed, problems, key)
    limit = getattr(passed.get("algorithm"), "dynamic_sampling_limit", lambda: None)()
    if staleness > 1 and limit is not None:
        problems.append(
            f"{key}.max_staleness={staleness} draws the prompts of the next {staleness} steps at once, and "
            f"dynamic sampling (algorithm.config.dynamic_sampling) draws more while they are in flight, so a "
            "checkpoint could not say where the data source was for each of them; use max_staleness <= 1 "
            "with dynamic sampling"
        )
    if is_dedicated(rollout, VLLMEngine):
        check_vllm(cfg, passed, problems, key)
    grouped = group_scorers(passed.get("reward"))
    if grouped and sampling is not None and bool(rollout.get("overlap_reward", True)):
        k, fbs = sampling.samples_per_prompt, rollout.get("forward_batch_size")
        shard = run.prompts_per_rollout * k // engines
        if shard % k or (fbs is not None and int(fbs) % k):
            problems.append(
                f"reward.backend.components.{grouped[0]} scores whole groups, but {key}.overlap_reward scores "
                f"each engine's forward batch as it arrives, and {key}.forward_batch_size={fbs} (an engine's "
                f"shard: {shard} samples) splits groups of sampling.samples_per_prompt={k}; set "
                f"{key}.forward_batch_size to a multiple of {k}, or {key}.overlap_reward=false"
            )


def group_scorers(reward: Any) -> list[str]:
    """The components of a built reward service that score whole groups (`groupwise = True`)."""
    components = getattr(getattr(reward, "backend", None), "components", None) or {}
    return [name for name, scorer in components.items() if getattr(scorer, "groupwise", False)]


def check_partial(partial: int, staleness: int, passed: dict[str, Any], problems: list[str], key: str) -> None:
    """Partial rollouts (`partial_tokens`): rollouts in flight at a sync (max_staleness >= 1) of a
    text model, paused before they could end in one segment."""
    if staleness == 0:
        problems.append(
            f"{key}.partial_tokens={partial}: partial rollouts pause the rollouts in flight at a weight sync "
            f"and resume them by the new weights, and with {key}.max_staleness=0 none is in flight; set "
            f"{key}.max_staleness >= 1 (or {key}.partial_tokens=null)"
        )
    model = passed.get("model")
    if model is not None and getattr(model, "modality", None) != "text":
        problems.append(
            f"{key}.partial_tokens={partial}: partial rollouts resume text samples from their tokens so far; "
            f"model._target_ builds a {type(model).__name__} ({getattr(model, 'modality', None)} model): set "
            f"{key}.partial_tokens=null"
        )
    sampling = passed.get("sampling")
    max_new = getattr(sampling, "max_new_tokens", None)
    if max_new is not None and partial >= max_new:
        problems.append(
            f"{key}.partial_tokens={partial} >= sampling.max_new_tokens={max_new}: every sample ends within "
            f"its first segment, so no rollout would ever be paused; set {key}.partial_tokens below "
            f"{max_new} (or null)"
        )


def check_vllm(cfg: DictConfig, passed: dict[str, Any], problems: list[str], key: str = "rollout") -> None:
    """A vLLM engine: vLLM installed, a text-only causal LM whose attention heads the device's
    kernels serve, and prompts + responses that fit `rollout.max_model_len`."""
    import importlib.util

    rollout = cfg.rollout
    if importlib.util.find_spec("vllm") is None:
        problems.append(f"{key}._target_={rollout._target_}: {INSTALL_HINT}")
    model = passed.get("model")
    if model is not None and (getattr(model, "modality", None) != "text" or getattr(model, "vision", True)):
        problems.append(
            f"{key}._target_={rollout._target_} samples text-only causal LMs; model._target_ builds a "
            f"{type(model).__name__}: use unirl.models.qwen.QwenConfig or the dedicated engine "
            "(unirl.rollout.dedicated.DedicatedEngine)"
        )
    elif model is not None and (
        model.tiny is not None or os.path.isfile(os.path.join(model.pretrained_path, "config.json"))
    ):
        if model.tiny is not None:
            head_dim, where = model.tiny.hidden_size // model.tiny.num_attention_heads, "model.tiny"
        else:
            import json

            with open(os.path.join(model.pretrained_path, "config.json")) as f:
                config = json.load(f)
            where = f"model.pretrained_path {model.pretrained_path!r}"
            served = [a for a in config.get("architectures") or [] if a in ARCHITECTURES]
            if not served:
                problems.append(
                    f"{where} holds a {config.get('architectures')}; {key}._target_={rollout._target_} "
                    f"serves {list(ARCHITECTURES)}: use the dedicated engine (unirl.rollout.dedicated.DedicatedEngine)"
                )
            head_dim = head_dim_of(SimpleNamespace(**config.get("text_config", config)))
        problem = head_dim_problem(int(head_dim), _device_type(), where)
        if problem:
            problems.append(problem)
    if rollout.get("lora_mode", "merged") == "adapter":
        from unirl.rollout.vllm.engine import VLLM_LORA_RANKS

        train = cfg.get("train")
        lora = train.get("lora") if isinstance(train, DictConfig) else None
        cap = rollout.get("max_lora_rank")
        if lora is None:
            problems.append(
                f"{key}.lora_mode=adapter serves the trainer's LoRA adapter, but train.lora is null; "
                f"set train.lora or {key}.lora_mode=merged"
            )
        elif cap is not None and (int(cap) not in VLLM_LORA_RANKS or int(lora.get("rank", 0)) > int(cap)):
            problems.append(
                f"{key}.max_lora_rank={cap}: vLLM takes one of {VLLM_LORA_RANKS}, at least "
                f"train.lora.rank={lora.get('rank')}; raise it or set it to null"
            )
    sampling, limit = passed.get("sampling"), rollout.get("max_model_len")
    if (
        sampling is not None
        and limit is not None
        and sampling.max_prompt_length + sampling.max_new_tokens > limit
    ):
        problems.append(
            f"sampling.max_prompt_length ({sampling.max_prompt_length}) + sampling.max_new_tokens "
            f"({sampling.max_new_tokens}) exceeds {key}.max_model_len={limit}: raise it (or null: the "
            "model's max_position_embeddings)"
        )
