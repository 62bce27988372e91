"""Ulysses sequence parallelism for a diffusers transformer, through diffusers' own context
parallelism (`diffusers.ContextParallelConfig`, the model class's `_cp_plan`).

With `train.parallel.sp = P`, the data-parallel ranks form groups of P consecutive ranks (rank r is
in group r // P) that hold the same samples. The transformer's context-parallel plan splits its
token sequences (image and text) into P shards at the model's entry, each attention runs an
all-to-all from sequence shards to head shards and back (`TemplatedUlyssesAttention`, with its
backward), and the output is all-gathered along the sequence at `proj_out`, so every rank of a
group sees the whole velocity: rollout, replay, log-probs and losses are computed identically on
each. Backward through the gather leaves each rank the gradient of its own tokens; their sum over
the group is the sample's gradient. FSDP2 averages gradients over all ranks, so the train stack
scales every loss by P (`TrainBackend.loss_multiplier`; FSDP2's own divide factor needs a
PREMUL_SUM reduction, which gloo lacks): the update is the mean over groups of the sum over each
group, the whole-batch gradient of unsharded training (`tests/train/test_sequence_parallel.py`).

A text-only transformers causal LM has no plan: its replay shards the token rows itself and runs
every attention layer through an all-to-all (`unirl.models.causal_lm.ulysses`); its rollout is
the model's own generate, the same samples on each rank of a group.

A family whose diffusers class has no plan may give its transformer one, with attention processors
that take the same `_parallel_config` (SD3: `unirl.models.sd3.attention`, which splits only the
image tokens and shards the text by heads inside attention). A plan may leave the text tokens
whole (SD3, Wan's cross-attention); `splits_text_tokens` says whether it splits them.

Works on any device the process group runs on (gloo on CPU, NCCL on GPUs): diffusers'
`enable_parallelism` resolves an accelerator, so the plan is applied here with a CPU-capable mesh.
A transformer without a plan cannot use it: `cp_plan_problem` says so.
"""

from __future__ import annotations

from typing import Any

import torch


def sequence_parallel_degree(cfg: Any) -> int:
    """`train.parallel.sp` of a recipe (plain dict or DictConfig; 1 without it): the ranks that
    share one sample shard."""
    parallel = (cfg.get("train") or {}).get("parallel")
    return int(parallel.get("sp", 1) or 1) if parallel else 1


def planned_parts(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a context-parallel plan applies to: `module` when it has diffusers' `_cp_plan`,
    else its children that do (Wan 2.2's two experts held as one module, `unirl.models.wan.experts`)."""
    if getattr(module, "_cp_plan", None) is not None:
        return [module]
    return [child for child in module.children() if getattr(child, "_cp_plan", None) is not None]


def is_causal_lm(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers model, whose replay runs Ulysses through
    `unirl.models.causal_lm.ulysses` rather than a diffusers plan."""
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def heads_problem(heads: int, sp: int) -> str | None:
    if heads % sp == 0:
        return None
    valid = [d for d in range(1, heads + 1) if heads % d == 0]
    return (
        f"train.parallel.sp={sp} does not divide the transformer's {heads} attention heads; "
        f"valid values (also dividing num_devices): {valid}"
    )


def cp_plan_problem(module: torch.nn.Module, sp: int) -> str | None:
    """Why `module` cannot run with Ulysses degree `sp`, or None: a text-only causal LM needs query
    heads divisible by `sp`; a diffusers transformer (or each of its planned parts,
    `planned_parts`) needs a context-parallel plan and heads divisible by `sp`."""
    if is_causal_lm(module):
        if getattr(module.config, "vision_config", None) is not None:
            return (
                f"train.parallel.sp={sp}: sequence-parallel replay runs on text-only causal LMs; "
                f"{type(module).__name__} is a vision-language model (set train.parallel.sp=1)"
            )
        return heads_problem(module.config.num_attention_heads, sp)
    parts = planned_parts(module)
    if not parts:
        return (
            f"train.parallel.sp={sp}: {type(module).__name__} has no context-parallel plan in diffusers "
            "(`_cp_plan`); sequence parallelism runs on SD3, FLUX.1, Wan and Qwen-Image transformers"
        )
    for part in parts:
        heads = getattr(getattr(part, "config", None), "num_attention_heads", None)
        if heads is not None and heads_problem(heads, sp):
            return heads_problem(heads, sp)
    return None


def splits_text_tokens(module: torch.nn.Module) -> bool:
    """Whether the context-parallel plan of `module` (or of its planned parts) splits the text
    tokens (`encoder_hidden_states`) into shards, so their count must divide by the degree."""
    for part in planned_parts(module):
        for entry in part._cp_plan.values():
            if isinstance(entry, dict) and "encoder_hidden_states" in entry:
                return True
    return False


def sp_mesh(device_type: str, world: int, sp: int):
    """The ("dp", "ring", "ulysses") mesh of world / sp groups of sp consecutive ranks (ring 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // sp, 1, sp), mesh_dim_names=("dp", "ring", "ulysses"))


def enable_ulysses(module: torch.nn.Module, sp: int, device_type: str | None = None) -> None:
    """Apply diffusers' Ulysses context parallelism of degree `sp` to `module` (a diffusers
    transformer with a `_cp_plan`, or a module of several: `planned_parts`), or attach the group to
    a transformers causal LM for its sharded replay (`unirl.models.causal_lm.ulysses`), in place,
    before FSDP wraps it. Needs the default process
    group; every rank of the world calls it. `device_type`: the mesh's (default: the module's
    device's; the memory planner passes "cpu" for a module on the meta device)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    problem = cp_plan_problem(module, sp)
    if problem:
        raise ValueError(problem)
    world = dist.get_world_size()
    if world % sp:
        raise ValueError(f"train.parallel.sp={sp} does not divide the {world} ranks")
    device = next(module.parameters()).device
    mesh = sp_mesh(device_type or device.type, world, sp)
    if is_causal_lm(module):
        from unirl.models.causal_lm.ulysses import attach

        attach(module, mesh["ulysses"].get_group())
        return
    cp = ContextParallelConfig(ulysses_degree=sp, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), world, device, mesh=mesh)
    for part in planned_parts(module):
        part._parallel_config = config
        for sub in part.modules():
            processor = getattr(sub, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config
        apply_context_parallel(part, cp, part._cp_plan)
