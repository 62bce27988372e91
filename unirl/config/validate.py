"""Validation of a recipe, run before any Ray work.

Two phases, both reporting every problem they find:

1. Every node is type- and range-checked (`check_recipe`): the top level and
   the plain sections against their schemas (`unirl.config.run`), every
   `_target_` node against its target (`unirl.config.schema.check_node`), and
   each target that can be built from the recipe alone is built, so its
   constructor's own checks run too.
2. Cross-component checks (one modality across sampling, model and
   algorithm; batch geometry; the modality's own checks: image size vs the
   model's patch grid, or the token budget vs the model's context; algorithm
   vs sampling / EMA / updates; FSDP blocks; resume) run on whatever phase 1
   built; a check is skipped only when one of its inputs failed phase 1.

Every problem names the recipe keys involved and says what is expected; all of
them are reported together in one `ConfigError`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from unirl.config.engines import check_rollout
from unirl.config.run import RL_SECTIONS, SFT_SECTIONS
from unirl.config.schema import check_node, target_parameters
from unirl.dataplane import TRANSPORTS, transport_problems
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams

SAMPLING_MODALITY = {DiffusionSamplingParams: "diffusion", TextSamplingParams: "text"}
ENTRY_POINTS = {"diffusion": "unirl.train_diffusion", "text": "unirl.train_vlm"}


class ConfigError(ValueError):
    """A recipe is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def target_nodes(node: Any, path: str = "") -> list[tuple[str, dict]]:
    """(key path, node) of every `_target_` node in a plain config tree, innermost first."""
    found = []
    if isinstance(node, dict):
        for key, child in node.items():
            found.extend(target_nodes(child, f"{path}.{key}" if path else str(key)))
        if "_target_" in node:
            found.append((path, node))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(target_nodes(item, f"{path}[{i}]"))
    return found


def _node_at(tree: dict, path: str) -> Any:
    node: Any = tree
    for part in path.split(".") if path else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _buildable(target: Any, node: dict) -> bool:
    """True when the recipe node gives every argument the target requires (nothing is injected later)."""
    return all(
        p.name in node or p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in target_parameters(target)
    )


def _build(node: dict, path: str, problems: list[str]) -> Any:
    try:
        return instantiate(node, _convert_="all")
    except Exception as exc:  # noqa: BLE001 - report the component and its error, then keep checking
        cause = exc.__cause__ or exc
        problems.append(f"{path}: {type(cause).__name__}: {cause}")
        return None


def check_recipe(cfg: DictConfig, sections: dict[str, type], problems: list[str]) -> dict[str, Any]:
    """Type- and range-check every node of `cfg`; append a problem for each failure.

    `sections` maps the path of each plain node ("" for the top level) to its
    schema dataclass. Returns {path: object} for every node that passed: the
    schema or dataclass instance, or the built class; None for a class that
    needs arguments only the trainer has (a stage needs its model bundle).
    """
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001 - an interpolation that does not resolve stops everything
        problems.append(f"the recipe does not resolve: {type(exc).__name__}: {exc}")
        return {}
    passed: dict[str, Any] = {}
    for path, schema in sections.items():
        node = _node_at(tree, path)
        if node is None:
            continue  # an optional section left out; a required one is named by its parent's schema
        if not isinstance(node, dict):
            problems.append(f"{path}: expected a mapping ({schema.__name__}), got {node!r}")
            continue
        instance, found = check_node(path, schema, node)
        problems.extend(found)
        if not found:
            passed[path] = instance
    failed: list[str] = []
    for path, node in target_nodes(tree):
        try:
            target = get_object(node["_target_"])
        except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
            problems.append(
                f"{path}._target_: unknown _target_ {node['_target_']!r} ({type(exc).__name__}: {exc}); "
                "check the class path"
            )
            failed.append(path)
            continue
        instance, found = check_node(path, target, node)
        if not found and instance is None and _buildable(target, node):
            if any(f.startswith(path + ".") or f.startswith(path + "[") for f in failed):
                continue  # a nested node failed and is reported; building would repeat it
            instance = _build(node, path, found)
        problems.extend(found)
        if found:
            failed.append(path)
        else:
            passed[path] = instance
    return passed


def _transport_check(cfg: DictConfig, problems: list[str]) -> None:
    node = cfg.get("transport")
    name = node.get("name") if isinstance(node, DictConfig) else None
    if name in TRANSPORTS:
        options = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
        _, found = check_node("transport", get_object(TRANSPORTS[name]), options)
        if found:
            problems.extend(found)
            return
    problems.extend(transport_problems(node))


def _model_geometry(model: Any) -> tuple[int, int | None] | None:
    """(pixels per latent patch, largest height/width or None) of an SD3 model config, when knowable."""
    if model is None or getattr(model, "modality", None) != "diffusion":
        return None
    if not model.pretrained_path:
        tiny = model.tiny
        return (1 if tiny.pixel_space else 2) * tiny.patch_size, tiny.resolution
    try:
        with open(os.path.join(model.pretrained_path, "transformer", "config.json")) as f:
            patch = json.load(f)["patch_size"]
        vae_config = os.path.join(model.pretrained_path, "vae", "config.json")
        scale = 1
        if os.path.exists(vae_config):
            with open(vae_config) as f:
                scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    except (OSError, KeyError, ValueError):
        return None  # an unreadable model directory is reported by the model checks
    return scale * patch, None


def _check_geometry(run: Any, sampling: Any, stack: Any, model: Any, problems: list[str]) -> None:
    """Batch geometry vs devices and micro-batches; image size vs the model's patch grid."""
    if run is not None and sampling is not None:
        world = run.num_devices
        total = run.prompts_per_rollout * sampling.samples_per_prompt
        if total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x sampling.samples_per_prompt "
                f"({sampling.samples_per_prompt}) = {total} samples do not split evenly over num_devices={world}"
            )
        elif stack is not None and (total // world) % stack.micro_batch_size:
            problems.append(
                f"batch geometry: train.stack.micro_batch_size={stack.micro_batch_size} does not divide the "
                f"per-rank batch of {total // world} samples (prompts_per_rollout x samples_per_prompt / num_devices)"
            )
    geometry = _model_geometry(model) if isinstance(sampling, DiffusionSamplingParams) else None
    if geometry is not None:
        cell, largest = geometry
        for key in ("height", "width"):
            value = getattr(sampling, key)
            if value % cell:
                problems.append(
                    f"sampling.{key}={value} must be a multiple of {cell}, the pixels per latent patch of the model"
                )
            if largest is not None and value > largest:
                problems.append(
                    f"sampling.{key}={value} exceeds model.tiny.resolution={largest}, the largest size "
                    "the tiny model's position embedding covers"
                )


def _check_algorithm(
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
                "(best vs worst by reward); set it to >= 2"
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


def _check_sde(cfg: DictConfig, sampling: DiffusionSamplingParams, problems: list[str]) -> None:
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


def _check_keep_graph(
    cfg: DictConfig, passed: dict[str, Any], modality: str | None, problems: list[str]
) -> None:
    """`rollout.keep_graph`: a diffusion recipe whose kept sampling graphs are the forwards the
    loss would replay (`unirl.train.stack.keep_graph_problems`), with no LoRA dropout."""
    from unirl.train.stack import keep_graph_problems

    rollout = cfg.get("rollout")
    if not isinstance(rollout, DictConfig):
        return
    if not rollout.get("keep_graph", False):
        if rollout.get("keep_graph_max_pairs") is not None:
            problems.append(
                f"rollout.keep_graph_max_pairs={rollout.keep_graph_max_pairs} has no effect with "
                "rollout.keep_graph=false; set rollout.keep_graph=true or remove it"
            )
        return
    if modality is not None and modality != "diffusion":
        problems.append(
            f"rollout.keep_graph keeps SDE-step graphs of diffusion rollouts, but this is a {modality} recipe; "
            "set rollout.keep_graph=false"
        )
        return
    stack, algorithm, lora = (passed.get(k) for k in ("train.stack", "algorithm", "train.lora"))
    if stack is not None and algorithm is not None and "train" in passed:
        full_finetune = cfg.train.get("lora") is None
        problems.extend(keep_graph_problems(algorithm, stack.num_updates_per_batch, full_finetune))
    if lora is not None and lora.dropout > 0:
        problems.append(
            f"rollout.keep_graph: train.lora.dropout={lora.dropout} differs between sampling (eval mode) and "
            "the loss (train mode), so a kept graph is not the trained function; set train.lora.dropout=0 or "
            "rollout.keep_graph=false"
        )


def _check_reward_backprop(
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


def _check_distributed(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """World size vs sharding, FSDP block names vs the model, resume keys."""
    from unirl.train.fsdp import unmatched_block_classes
    from unirl.trainer.checkpoints import resolve_resume_path

    run, train, model, fsdp = (passed.get(k) for k in ("", "train", "model", "train.fsdp"))
    if run is None or train is None:
        return
    if run.num_devices > 1 and train.fsdp is None:
        problems.append(
            f"num_devices={run.num_devices} needs train.fsdp (FSDP2 sharding settings); see the tiny recipe"
        )
    if (
        run.num_devices == 1
        and fsdp is not None
        and fsdp.param_dtype != "float32"
        and cfg.stage.get("autocast_dtype") is None
    ):
        problems.append(
            f"train.fsdp.param_dtype={fsdp.param_dtype}: FSDP2's mixed-precision policy acts only when sharded "
            "(num_devices > 1); one rank trains the plain module in its own dtype. Set stage.autocast_dtype="
            f"{fsdp.param_dtype} for low-precision compute on one rank, or train.fsdp.param_dtype=float32"
        )
    model_readable = model is not None and (not model.pretrained_path or os.path.isdir(model.pretrained_path))
    lora = passed.get("train.lora")
    if (fsdp is not None or lora is not None) and model_readable and hasattr(model, "trainable_on_meta"):
        try:
            denoiser = model.trainable_on_meta()
        except Exception as exc:  # noqa: BLE001 - an unreadable model config is reported, not raised
            problems.append(f"model: cannot read the trainable model's config ({type(exc).__name__}: {exc})")
            denoiser = None
        if denoiser is not None and lora is not None:
            from unirl.train.backend import lora_target_problem

            problem = lora_target_problem(denoiser, lora.target_modules)
            if problem:
                problems.append(problem)
        if denoiser is not None and fsdp is not None:
            missing = unmatched_block_classes(denoiser, fsdp.block_classes)
            if missing:
                present = sorted(
                    {
                        type(m).__name__
                        for m in denoiser.modules()
                        if "Block" in type(m).__name__ or "Layer" in type(m).__name__
                    }
                )
                problems.append(
                    f"train.fsdp.block_classes {missing} match no module of {type(denoiser).__name__} "
                    f"(block classes present: {present}); sharding would silently not happen"
                )
    if "model" in passed:
        try:
            resolve_resume_path(cfg)
        except (ValueError, OSError, KeyError) as exc:
            problems.append(str(exc))


def _target_class(cfg: DictConfig, key: str) -> type | None:
    try:
        return get_object(cfg[key]["_target_"])
    except Exception:  # noqa: BLE001 - a missing or unknown target is reported by check_recipe
        return None


def _check_modality(
    cfg: DictConfig,
    sampling: Any,
    model: Any,
    algorithm: type | None,
    expect: str | None,
    problems: list[str],
) -> str | None:
    """One modality across sampling, model and algorithm (and the entry point); returns it."""
    modality = next((m for kind, m in SAMPLING_MODALITY.items() if isinstance(sampling, kind)), None)
    if modality is None:
        return None
    parts = {"model": getattr(model, "modality", None), "algorithm": getattr(algorithm, "modality", None)}
    for key, other in parts.items():
        if other is not None and other != modality:
            target = cfg[key]["_target_"] if key in cfg else "?"
            problems.append(
                f"{key}: {target} is a {other} component but sampling ({type(sampling).__name__}) makes this a "
                f"{modality} recipe; use a {modality} {key}"
            )
    if expect is not None and modality != expect:
        problems.append(
            f"sampling: this is a {modality} recipe ({type(sampling).__name__}); run it with "
            f"`python -m {ENTRY_POINTS[modality]}`, not {ENTRY_POINTS[expect]}"
        )
    return modality


def _check_text(cfg: DictConfig, sampling: TextSamplingParams, model: Any, problems: list[str]) -> None:
    """Text recipes: the token budget fits the model's context; no image-only sections."""
    tiny = getattr(model, "tiny", None) if model is not None else None
    context = getattr(tiny, "max_position_embeddings", None)
    if context is not None and sampling.max_prompt_length + sampling.max_new_tokens > context:
        problems.append(
            f"sampling.max_prompt_length ({sampling.max_prompt_length}) + sampling.max_new_tokens "
            f"({sampling.max_new_tokens}) exceeds model.tiny.max_position_embeddings={context}, the model's context"
        )
    path = getattr(model, "pretrained_path", None)
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            from transformers import AutoConfig, AutoTokenizer

            config = AutoConfig.from_pretrained(path, local_files_only=True)
            tokens = len(AutoTokenizer.from_pretrained(path, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - an unreadable directory is reported, not raised
            problems.append(f"model.pretrained_path {path!r}: cannot read its config or tokenizer ({exc})")
        else:
            rows = getattr(config, "vocab_size", None)
            if rows is not None and tokens > rows:
                problems.append(
                    f"model.pretrained_path {path!r}: the tokenizer has {tokens} tokens but config.json's "
                    f"vocab_size is {rows}; ids >= {rows} would index past the embedding. Use the tokenizer "
                    "saved with this model"
                )
            context = getattr(config, "max_position_embeddings", None)
            if context is not None and sampling.max_prompt_length + sampling.max_new_tokens > context:
                problems.append(
                    f"sampling.max_prompt_length ({sampling.max_prompt_length}) + sampling.max_new_tokens "
                    f"({sampling.max_new_tokens}) exceeds the model's max_position_embeddings={context} ({path})"
                )


EVAL_SAMPLING = {
    "diffusion": "unirl.trainer.evaluation.EvalSampling",
    "text": "unirl.trainer.text_eval.TextEvalSampling",
}


def _check_eval_sampling(cfg: DictConfig, modality: str | None, problems: list[str]) -> None:
    """The eval block samples as its modality does (images: EvalSampling; text: TextEvalSampling)."""
    ev = cfg.get("eval")
    if modality is None or ev is None or not isinstance(ev.get("sampling"), DictConfig):
        return
    target, want = ev.sampling.get("_target_"), EVAL_SAMPLING[modality]
    if target != want:
        problems.append(f"eval.sampling: a {modality} recipe evaluates with {want}, got {target}")


def validate_rl_config(cfg: DictConfig, expect: str | None = None) -> None:
    """Raise `ConfigError` listing every problem of an RL recipe (diffusion or text).

    Args:
        expect: the modality the entry point runs ("diffusion" or "text"); a
            recipe of the other modality is a problem naming the right entry point.
    """
    problems: list[str] = []
    passed = check_recipe(cfg, RL_SECTIONS, problems)
    _transport_check(cfg, problems)
    model = passed.get("model")
    if model is not None and model.pretrained_path and not os.path.isdir(model.pretrained_path):
        kind = {"text": "Hugging Face causal-LM (Qwen3 / Qwen2)"}.get(
            getattr(model, "modality", None), "diffusers SD3 / SD3.5"
        )
        problems.append(
            f"model.pretrained_path: {model.pretrained_path!r} is not a directory; point it (or PRETRAINED_MODEL) at "
            f"a local {kind} directory, or set it to null to use model.tiny"
        )
    sampling, stack = passed.get("sampling"), passed.get("train.stack")
    algorithm = _target_class(cfg, "algorithm") if "algorithm" in cfg else None
    modality = _check_modality(cfg, sampling, model, algorithm, expect, problems)
    _check_geometry(passed.get(""), sampling, stack, model, problems)
    if modality == "text":
        _check_text(cfg, sampling, model, problems)
    _check_eval_sampling(cfg, modality, problems)
    _check_algorithm(algorithm, sampling, stack, passed.get("train"), passed.get("eval"), problems)
    _check_keep_graph(cfg, passed, modality, problems)
    if modality == "diffusion":
        _check_sde(cfg, sampling, problems)
    _check_reward_backprop(cfg, algorithm, passed.get("algorithm"), sampling, problems)
    check_advantage = getattr(passed.get("algorithm"), "check_advantage", None)
    advantage = passed.get("advantage")
    if callable(check_advantage) and advantage is not None:
        try:
            check_advantage(advantage)
        except ValueError as exc:
            problems.append(str(exc))
    if advantage is not None and modality == "diffusion" and getattr(advantage, "needs_tokens", False):
        problems.append(
            f"advantage: estimator={advantage.estimator} with kl_coef={advantage.kl_coef} needs per-token "
            "data that diffusion tracks do not have; use estimator grpo or rloo with kl_coef 0"
        )
    if advantage is not None and getattr(advantage, "estimator", "grpo") == "rloo" and sampling is not None:
        if sampling.samples_per_prompt < 2:
            problems.append(
                f"advantage.estimator=rloo compares each sample with its siblings: sampling.samples_per_prompt "
                f"must be >= 2, got {sampling.samples_per_prompt}"
            )
    _check_distributed(cfg, passed, problems)
    check_rollout(cfg, passed, problems)
    if problems:
        raise ConfigError(problems)


def validate_sft_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every problem of a supervised (`unirl.train_sft`) recipe."""
    problems: list[str] = []
    check_recipe(cfg, SFT_SECTIONS, problems)
    if problems:
        raise ConfigError(problems)
