"""Rules of the algorithm against the rest of the recipe.

What an algorithm declares (class attributes such as `supports_multi_update`,
`requires_sde_logprobs`, `compares_within_groups`, `requires_ema_rollout`,
`requires_trajectory`, `requires_ode_rollout`; methods `check_advantage`, `check_sampling`)
is checked against the sampling, the train stack, EMA, the SDE strategy, kept rollout graphs
and the advantage estimator. An algorithm states a new need by such an attribute or method;
the rule that reads it goes here.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from unirl.types.sampling import DiffusionSamplingParams


def check_algorithm(
    algorithm: type | None, sampling: Any, stack: Any, train: Any, ev: Any, problems: list[str]
) -> None:
    """The algorithm's needs vs sampling, updates per rollout and EMA; eval from the EMA."""
    name = algorithm.__name__ if algorithm is not None else None
    if (
        algorithm is not None
        and stack is not None
        and stack.num_updates_per_batch > 1
        and not getattr(algorithm, "supports_multi_update", False)
    ):
        problems.append(
            f"train.stack.num_updates_per_batch={stack.num_updates_per_batch}: {name} does not "
            "support several updates per rollout; set it to 1"
        )
    if algorithm is not None and isinstance(sampling, DiffusionSamplingParams):
        if getattr(algorithm, "requires_sde_logprobs", False) and sampling.eta == 0:
            problems.append(
                f"sampling.eta=0 gives no SDE steps, but {name} needs step log-probs; set sampling.eta > 0"
            )
    if algorithm is not None and getattr(algorithm, "compares_within_groups", False) and sampling is not None:
        k = sampling.samples_per_prompt
        if k < 2:
            problems.append(
                f"sampling.samples_per_prompt={k}: {name} compares the samples of a prompt group "
                "with each other; set it to >= 2"
            )
        elif stack is not None and stack.micro_batch_size % k:
            problems.append(
                f"train.stack.micro_batch_size={stack.micro_batch_size}: {name} compares the samples of a "
                f"prompt group, so each micro-batch must hold whole groups; set it to a multiple of "
                f"sampling.samples_per_prompt={k}"
            )
    if train is None:
        return
    fix = "set train.ema to {_target_: unirl.train.ema.EMAConfig, decay: 0.999}"
    if algorithm is not None and getattr(algorithm, "requires_ema_rollout", False) and train.ema is None:
        problems.append(f"algorithm: {name} samples rollouts from EMA weights, but train.ema is null; {fix}")
    if ev is not None and ev.use_ema and train.ema is None:
        problems.append(f"eval.use_ema=true evaluates the EMA weights, but train.ema is null; {fix}")


def check_ema_use(built: Any, train: Any, problems: list[str]) -> None:
    """An algorithm whose loss evaluates the EMA weights (its `needs_ema`: AWM's KL to the EMA
    policy) needs `train.ema`."""
    if built is None or train is None or not getattr(built, "needs_ema", False) or train.ema is not None:
        return
    problems.append(
        f"algorithm: {type(built).__name__} measures a KL to the EMA of the policy (algorithm.config.ema_kl_beta > 0), "
        "but train.ema is null; set train.ema to {_target_: unirl.train.ema.EMAConfig, decay: 0.9} "
        "or algorithm.config.ema_kl_beta: 0"
    )


def check_chained_algorithm(built: Any, problems: list[str]) -> None:
    """A track of a chain (composed or unified) trains on the batch its parent's samples made:
    dynamic sampling (DAPO's `dynamic_sampling`), which draws more prompts until enough groups
    differ, belongs to a single-track run (`unirl.trainer.graph`)."""
    if built is None or getattr(built, "dynamic_sampling_limit", lambda: None)() is None:
        return
    problems.append(
        f"algorithm.config.dynamic_sampling=true: {type(built).__name__} would draw more prompts until "
        "enough groups have unequal rewards, which only a single-track run does (a chained track trains on "
        "what its parent's samples made); set algorithm.config.dynamic_sampling: false"
    )


def check_sde(cfg: DictConfig, sampling: DiffusionSamplingParams, problems: list[str]) -> None:
    """`stage.sde` names a strategy that takes the sampling's eta and has noise on every step
    the SDE-step scheduler may pick (CPS has none on the last step)."""
    import torch

    from unirl.sde.schedules import sigmas_for
    from unirl.sde.strategies import make_strategy

    stage = cfg.get("stage")
    name = stage.get("sde", "flow") if isinstance(stage, DictConfig) else None
    if not isinstance(name, str):
        return  # a missing stage or a non-string sde is reported by check_recipe
    try:
        strategy = make_strategy(name, sampling.eta)
    except ValueError as exc:
        problems.append(str(exc))
        return
    if sampling.eta == 0 or not hasattr(strategy, "mean_and_std"):
        return
    # where a step's std vanishes (sigma' = 0) does not depend on the shift, so any token count will do
    sigmas, zero = sigmas_for(sampling, sampling.base_seq_len), torch.zeros(1)
    stds = {i: float(strategy.mean_and_std(zero, zero, sigmas, i)[1]) for i in sampling.possible_sde_steps()}
    silent = [i for i, std in stds.items() if not std > 0]
    if silent:
        problems.append(
            f"stage.sde={name} has no noise on step(s) {silent} (sigma' = 0), so they cannot be SDE steps, but "
            f"sampling.sde_scheduler={sampling.sde_scheduler} may pick them; bound the SDE steps below them "
            f"(sampling.sde_window hi <= {min(silent) / sampling.num_steps:.3g} with sde_scheduler random or sliding, "
            "or sde_steps without them)"
        )


def check_keep_graph(
    cfg: DictConfig, passed: dict[str, Any], modality: str | None, problems: list[str]
) -> None:
    """`rollout.keep_graph` (a composed track's `engine.keep_graph`): a diffusion track whose kept
    sampling graphs are the forwards the loss would replay
    (`unirl.train.stack.keep_graph_problems`), with no LoRA dropout."""
    from unirl.train.stack import keep_graph_problems

    key = "rollout" if "rollout" in cfg else "engine"
    rollout = cfg.get(key)
    if not isinstance(rollout, DictConfig):
        return
    if not rollout.get("keep_graph", False):
        if rollout.get("keep_graph_max_pairs") is not None:
            problems.append(
                f"{key}.keep_graph_max_pairs={rollout.keep_graph_max_pairs} has no effect with "
                f"{key}.keep_graph=false; set {key}.keep_graph=true or remove it"
            )
        return
    if modality is not None and modality != "diffusion":
        problems.append(
            f"{key}.keep_graph keeps SDE-step graphs of diffusion rollouts, but this is a {modality} recipe; "
            f"set {key}.keep_graph=false"
        )
        return
    stack, algorithm, lora = (passed.get(k) for k in ("train.stack", "algorithm", "train.lora"))
    if stack is not None and algorithm is not None and "train" in passed:
        full_finetune = cfg.train.get("lora") is None
        problems.extend(keep_graph_problems(algorithm, stack.num_updates_per_batch, full_finetune, key))
    if lora is not None and lora.dropout > 0:
        problems.append(
            f"{key}.keep_graph: train.lora.dropout={lora.dropout} differs between sampling (eval mode) and "
            "the loss (train mode), so a kept graph is not the trained function; set train.lora.dropout=0 or "
            f"{key}.keep_graph=false"
        )


def check_reward_backprop(
    cfg: DictConfig, algorithm: type | None, built: Any, sampling: Any, problems: list[str]
) -> None:
    """Reward-backprop algorithms (DRaFT, AlignProp, ReFL) re-run an ODE rollout's stored steps:
    the stage must store the trajectory, sampling must be ODE, and their step counts fit it."""
    if algorithm is None or not isinstance(sampling, DiffusionSamplingParams):
        return
    name = algorithm.__name__
    stage = cfg.get("stage")
    if getattr(algorithm, "requires_trajectory", False) and not (
        stage is not None and stage.get("store_trajectory")
    ):
        problems.append(
            f"stage.store_trajectory: {name} restarts the sampler from stored latents; set stage.store_trajectory: true"
        )
    if getattr(algorithm, "requires_ode_rollout", False):
        if sampling.eta != 0:
            problems.append(f"sampling.eta={sampling.eta}: {name} re-runs ODE rollouts; set sampling.eta: 0")
        if getattr(sampling, "ode_solver", "euler") != "euler":
            problems.append(
                f"sampling.ode_solver={sampling.ode_solver}: {name} re-runs the rollout's Euler steps; set it to euler"
            )
    check = getattr(built, "check_sampling", None)
    if callable(check):
        try:
            check(sampling)
        except ValueError as exc:
            problems.append(str(exc))


def check_advantage(
    built: Any, advantage: Any, group: tuple[int, str] | None, modality: str | None, problems: list[str]
) -> None:
    """The advantage estimator vs the algorithm (its `check_advantage`), the modality (token-level
    estimators need text, but gae without KL runs over a diffusion track's SDE steps) and the
    group size (RLOO needs siblings). `group`: (samples a group holds, the key that sets it)."""
    check = getattr(built, "check_advantage", None)
    if callable(check) and advantage is not None:
        try:
            check(advantage)
        except ValueError as exc:
            problems.append(str(exc))
    per_step_gae = getattr(advantage, "estimator", None) == "gae" and getattr(advantage, "kl_coef", 0) == 0
    if (
        advantage is not None
        and modality == "diffusion"
        and getattr(advantage, "needs_tokens", False)
        and not per_step_gae  # GAE over the SDE steps (Flow-PPO's critic values each step)
    ):
        problems.append(
            f"advantage: estimator={advantage.estimator} with kl_coef={advantage.kl_coef} needs per-token "
            "data that diffusion tracks do not have; use estimator grpo or rloo (or gae with a critic) "
            "with kl_coef 0"
        )
    if advantage is not None and getattr(advantage, "estimator", "grpo") == "rloo" and group is not None:
        size, key = group
        if size < 2:
            problems.append(
                f"advantage.estimator=rloo compares each sample with its siblings: {key} must be >= 2, got {size}"
            )
