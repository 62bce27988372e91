"""Rules of how a run spreads over devices and what it trains there.

num_devices vs FSDP sharding and its mixed-precision policy; the FSDP block classes and the
LoRA target modules vs the module tree of the trained model (built on the meta device, no
weights read); the data-plane transport; the checkpoint a run resumes from.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from unirl.config.schema import check_node
from unirl.dataplane import TRANSPORTS, transport_problems

_META_MODULES: dict[str, Any] = {}


def meta_module(model: Any) -> Any:
    """`model.trainable_on_meta()`: the trained module tree on the meta device, for reading names.

    The tree is a function of the model's config and, with a `pretrained_path`, of the JSON
    config files in that directory (no weights are read), so it is built once per config and
    file state (path, size, modification time of each JSON file) and shared: validating a recipe
    many times, as the tests do, would otherwise rebuild it each time. Callers only read it."""
    key = f"{type(model).__module__}.{type(model).__qualname__}:{model!r}"
    if path := getattr(model, "pretrained_path", None):
        files = sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True))
        key += repr([(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files])
    if key not in _META_MODULES:
        if len(_META_MODULES) >= 8:
            _META_MODULES.pop(next(iter(_META_MODULES)))
        _META_MODULES[key] = model.trainable_on_meta()
    return _META_MODULES[key]


def check_transport(cfg: DictConfig, problems: list[str]) -> None:
    """The data-plane transport: a known name (`unirl.dataplane.TRANSPORTS`) whose options its class
    takes, and whose extra is installed."""
    node = cfg.get("transport")
    name = node.get("name") if isinstance(node, DictConfig) else None
    if name in TRANSPORTS:
        options = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
        _, found = check_node("transport", get_object(TRANSPORTS[name]), options)
        if found:
            problems.extend(found)
            return
    problems.extend(transport_problems(node))


def check_this_machine(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """What this machine must have for the run to start here: a GPU for an in-process run that
    offloads activations (a Ray run's worker checks its own device when it starts)."""
    stack = passed.get("train.stack")
    if getattr(stack, "offload_activations", False) and cfg.get("launcher") == "in_process":
        import torch

        if not torch.cuda.is_available():
            problems.append(
                "train.stack.offload_activations=true needs a GPU worker, and this in-process run's worker "
                "computes on the CPU (torch sees no CUDA device), where saved tensors already are in host "
                "memory: set it to false"
            )


def check_sequence_parallel(cfg: DictConfig, passed: dict[str, Any], sp: int, problems: list[str]) -> None:
    """`train.parallel.sp` > 1 (Ulysses): it divides num_devices, the token sequences split evenly, and
    the run is one whose ranks it supports (Ray workers sampling trainside, no critic)."""
    run, sampling, model = passed.get(""), passed.get("sampling"), passed.get("model")
    if run.num_devices % sp:
        divisors = [d for d in range(1, run.num_devices + 1) if run.num_devices % d == 0]
        problems.append(
            f"train.parallel.sp={sp} does not divide num_devices={run.num_devices}; valid values: {divisors}"
        )
    if cfg.get("launcher") == "in_process":
        problems.append(f"train.parallel.sp={sp} needs {sp} or more Ray workers: launcher=in_process runs one")
    rollout = cfg.get("rollout") or {}
    if not str(rollout.get("_target_", "")).endswith("TrainsideEngine"):
        problems.append(
            f"train.parallel.sp={sp} runs with trainside rollouts (unirl.rollout.trainside.TrainsideEngine) only"
        )
    if cfg.get("critic") is not None:
        problems.append(f"train.parallel.sp={sp} with a critic is not supported")
    fsdp = passed.get("train.fsdp")
    if fsdp is not None and fsdp.activation_checkpointing and model is not None and is_text_model(model):
        problems.append(
            f"train.parallel.sp={sp} with train.fsdp.activation_checkpointing=true on a causal LM: the "
            "recomputed attention would run outside the sharded replay; set one of them off"
        )
    if sampling is not None and model is not None and hasattr(model, "build"):
        text = getattr(sampling, "max_sequence_length", None)
        if text is not None and text % sp and text_tokens_split(model):
            problems.append(
                f"train.parallel.sp={sp} does not divide sampling.max_sequence_length={text}: the text tokens split "
                "into sp shards (pad the prompts to a multiple of sp)"
            )
        try:  # the family's own count, from its bundle built on the meta device (no storage)
            import torch

            with torch.device("meta"):
                tokens = model.build().image_seq_len(sampling.height, sampling.width)
        except Exception:  # noqa: BLE001 - the model's own checks report an unbuildable config
            tokens = None
        if tokens is not None and tokens % sp:
            problems.append(
                f"train.parallel.sp={sp} does not divide the {tokens} image tokens of sampling.height x width: "
                "choose a size whose token grid splits into sp shards"
            )


def is_text_model(model: Any) -> bool:
    """Whether the trained module of `model` (a model config) is a transformers model (a causal
    LM, whose replay shards through `unirl.models.causal_lm.ulysses`); False when unreadable."""
    if not hasattr(model, "trainable_on_meta"):
        return False
    from unirl.train.sequence_parallel import is_causal_lm

    try:
        return is_causal_lm(meta_module(model))
    except Exception:  # noqa: BLE001 - an unreadable model config is check_module_tree's report
        return False


def text_tokens_split(model: Any) -> bool:
    """Whether the trained module's sequence-parallel plan splits the text tokens (FLUX.1,
    Qwen-Image) rather than keeping them whole on every rank (SD3, Wan); True when the tree cannot
    be read (the module-tree check reports that)."""
    if not hasattr(model, "trainable_on_meta"):
        return True
    from unirl.train.sequence_parallel import planned_parts, splits_text_tokens

    try:
        tree = meta_module(model)
    except Exception:  # noqa: BLE001 - an unreadable model config is check_module_tree's report
        return True
    return splits_text_tokens(tree) or not planned_parts(tree)


def check_distributed(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """World size vs sharding (the module tree vs LoRA and FSDP is a track rule: `check_module_tree`)."""
    run, train, fsdp = (passed.get(k) for k in ("", "train", "train.fsdp"))
    if run is None or train is None:
        return
    if run.num_devices > 1 and train.fsdp is None:
        problems.append(
            f"num_devices={run.num_devices} needs train.fsdp (FSDP2 sharding settings); see the tiny recipe"
        )
    parallel = train.parallel
    divisors = [d for d in range(1, run.num_devices + 1) if run.num_devices % d == 0]
    if run.num_devices % parallel.replicate:
        problems.append(
            f"train.parallel.replicate={parallel.replicate} does not divide num_devices={run.num_devices}: "
            f"HSDP's mesh is replicate x shard = num_devices ranks; valid values: {divisors}"
        )
    elif parallel.shard is not None and parallel.replicate * parallel.shard != run.num_devices:
        problems.append(
            f"train.parallel: replicate x shard = {parallel.replicate} x {parallel.shard} = "
            f"{parallel.replicate * parallel.shard} ranks, but num_devices={run.num_devices}; set "
            f"train.parallel.shard={run.num_devices // parallel.replicate} (or null: num_devices / replicate)"
        )
    if fsdp is not None and fsdp.offload_params and run.num_devices == 1:
        problems.append(
            "train.fsdp.offload_params=true with num_devices=1: FSDP2 shards (and offloads) the module over "
            "two or more ranks only, so one rank would keep every parameter on its device; raise num_devices "
            "or set it to false"
        )
    if parallel.sp > 1:
        check_sequence_parallel(cfg, passed, parallel.sp, problems)
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


def check_module_tree(
    model: Any,
    lora: Any,
    fsdp: Any,
    problems: list[str],
    section: str = "train",
    model_key: str = "model",
    sp: int = 1,
) -> None:
    """A trained module's LoRA target modules, FSDP block classes and sequence-parallel plan vs its
    module tree (`model.trainable_on_meta()`, built on the meta device: no weights read); keys
    relative to the track: `<section>.lora...`, `<section>.fsdp...` (a policy's `train`, a
    critic's `critic`) and `model_key` for a model config that cannot be read; `sp`: the
    Ulysses degree (`train.parallel.sp`) the tree must support."""
    readable = model is not None and (
        not getattr(model, "pretrained_path", None) or os.path.isdir(model.pretrained_path)
    )
    if (fsdp is None and lora is None) or not readable or not hasattr(model, "trainable_on_meta"):
        return
    from unirl.train.backend import lora_target_problem
    from unirl.train.fsdp import unmatched_block_classes

    try:
        tree = meta_module(model)
    except Exception as exc:  # noqa: BLE001 - an unreadable model config is reported, not raised
        problems.append(f"{model_key}: cannot read the trainable model's config ({type(exc).__name__}: {exc})")
        return
    if lora is not None:
        problem = lora_target_problem(tree, lora.target_modules, f"{section}.lora.target_modules")
        if problem:
            problems.append(problem)
    if sp > 1:
        from unirl.train.sequence_parallel import cp_plan_problem

        problem = cp_plan_problem(tree, sp)
        if problem:
            problems.append(problem)
    if fsdp is not None:
        missing = unmatched_block_classes(tree, fsdp.block_classes)
        if missing:
            present = sorted(
                {type(m).__name__ for m in tree.modules() if "Block" in type(m).__name__ or "Layer" in type(m).__name__}
            )
            problems.append(
                f"{section}.fsdp.block_classes {missing} match no module of {type(tree).__name__} "
                f"(block classes present: {present}); sharding would silently not happen"
            )
