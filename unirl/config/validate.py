"""Cross-component validation of a diffusion recipe, run before any Ray work.

Every check names the recipe keys involved and says how to fix them. All
problems are collected and reported together in one `ConfigError`.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.utils import get_class, get_object
from omegaconf import DictConfig, ListConfig

from unirl.dataplane import transport_problems

REQUIRED_KEYS = (
    "num_devices",
    "num_steps",
    "seed",
    "output_dir",
    "prompts_per_rollout",
    "sampling",
    "model",
    "stage",
    "rollout",
    "reward",
    "advantage",
    "algorithm",
    "train",
    "data_source",
    "transport",
)


class ConfigError(ValueError):
    """A recipe is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def iter_targets(node: Any, path: str = "") -> list[tuple[str, str]]:
    """(key path, `_target_` string) for every `_target_` in the config tree."""
    found = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            child_path = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                found.append((child_path, node[key]))
            else:
                found.extend(iter_targets(node.get(key), child_path))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            found.extend(iter_targets(item, f"{path}[{i}]"))
    return found


def check_targets(cfg: DictConfig, problems: list[str]) -> None:
    """Append a problem for every `_target_` that does not import."""
    for path, target in iter_targets(cfg):
        try:
            get_object(target)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
            problems.append(
                f"{path}: unknown _target_ {target!r} ({type(exc).__name__}: {exc}); check the class path"
            )


def _build(node: Any, key: str, problems: list[str]) -> Any:
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all")
    except Exception as exc:  # noqa: BLE001 - report the component and its error, then keep checking
        cause = exc.__cause__ or exc
        problems.append(f"{key}: {type(cause).__name__}: {cause}")
        return None


def _check_distributed(cfg: DictConfig, problems: list[str]) -> None:
    """World size vs sharding, FSDP block names vs the model, checkpoint and resume keys."""
    from unirl.train.fsdp import unmatched_block_classes
    from unirl.trainer.checkpoints import resolve_resume_path

    fsdp = cfg.train.get("fsdp")
    if cfg.num_devices > 1 and fsdp is None:
        problems.append(
            f"num_devices={cfg.num_devices} needs train.fsdp (FSDP2 sharding settings); see the tiny recipe"
        )
    if fsdp is not None and hasattr(get_class(cfg.model._target_), "denoiser_on_meta"):
        model_cfg = _build(cfg.model, "model", problems)
        fsdp_cfg = _build(fsdp, "train.fsdp", problems)
        if model_cfg is not None and fsdp_cfg is not None:
            try:
                denoiser = model_cfg.denoiser_on_meta()
            except Exception as exc:  # noqa: BLE001 - an unreadable model config is reported, not raised
                problems.append(f"model: cannot read the denoiser config ({type(exc).__name__}: {exc})")
            else:
                missing = unmatched_block_classes(denoiser, fsdp_cfg.block_classes)
                if missing:
                    present = sorted(
                        {type(m).__name__ for m in denoiser.modules() if "Block" in type(m).__name__}
                    )
                    problems.append(
                        f"train.fsdp.block_classes {missing} match no module of {type(denoiser).__name__} "
                        f"(block classes present: {present}); sharding would silently not happen"
                    )
    every = (cfg.get("checkpoint") or {}).get("every_n_steps", 0)
    if every is not None and (not isinstance(every, int) or every < 0):
        problems.append(f"checkpoint.every_n_steps must be an integer >= 0 (0 disables), got {every!r}")
    try:
        resolve_resume_path(cfg)
    except (ValueError, OSError, KeyError) as exc:
        problems.append(str(exc))


def validate_diffusion_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every problem of a diffusion recipe."""
    problems: list[str] = []
    missing = [k for k in REQUIRED_KEYS if k not in cfg or cfg[k] is None]
    if missing:
        raise ConfigError(
            [f"missing top-level key(s) {missing}; every diffusion recipe sets {list(REQUIRED_KEYS)}"]
        )
    for key in ("num_devices", "num_steps", "prompts_per_rollout"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            problems.append(f"{key}: must be an integer >= 1, got {cfg[key]!r}")
    check_targets(cfg, problems)
    problems.extend(transport_problems(cfg.transport))
    if problems:
        raise ConfigError(problems)

    model_path = cfg.model.get("pretrained_path")
    if model_path and not os.path.isdir(str(model_path)):
        problems.append(
            f"model.pretrained_path: {model_path!r} is not a directory; point it (or PRETRAINED_MODEL) at a local "
            "diffusers SD3 / SD3.5 directory, or set it to null to use model.tiny"
        )

    sampling = _build(cfg.sampling, "sampling", problems)
    stack = _build(cfg.train.stack, "train.stack", problems)
    _build(cfg.train.optim, "train.optim", problems)
    if cfg.train.get("lora") is not None:
        _build(cfg.train.lora, "train.lora", problems)
    _build(cfg.advantage, "advantage", problems)
    algorithm_cls = get_class(cfg.algorithm._target_)
    if cfg.algorithm.get("config") is not None:
        _build(cfg.algorithm.config, "algorithm.config", problems)

    if sampling is not None and stack is not None:
        world = cfg.num_devices
        total = cfg.prompts_per_rollout * sampling.samples_per_prompt
        if total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({cfg.prompts_per_rollout}) x sampling.samples_per_prompt "
                f"({sampling.samples_per_prompt}) = {total} samples do not split evenly over num_devices={world}"
            )
        else:
            per_rank = total // world
            if per_rank % stack.micro_batch_size:
                problems.append(
                    f"batch geometry: train.stack.micro_batch_size={stack.micro_batch_size} does not divide the "
                    f"per-rank batch of {per_rank} samples (prompts_per_rollout x samples_per_prompt / num_devices)"
                )
        fbs = cfg.rollout.get("forward_batch_size")
        if fbs is not None and (not isinstance(fbs, int) or fbs < 1):
            problems.append(f"rollout.forward_batch_size: must be an integer >= 1 or null, got {fbs!r}")
    if (
        stack is not None
        and stack.num_updates_per_batch > 1
        and not getattr(algorithm_cls, "supports_multi_update", False)
    ):
        problems.append(
            f"train.stack.num_updates_per_batch={stack.num_updates_per_batch}: {algorithm_cls.__name__} does not "
            "support several updates per rollout; set it to 1"
        )
    _check_distributed(cfg, problems)
    if sampling is not None and getattr(algorithm_cls, "requires_sde_logprobs", False) and sampling.eta == 0:
        problems.append(
            f"sampling.eta=0 gives no SDE steps, but {algorithm_cls.__name__} needs step log-probs; set sampling.eta > 0"
        )
    if problems:
        raise ConfigError(problems)
