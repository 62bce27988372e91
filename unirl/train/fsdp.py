"""FSDP2 wrapping of a denoiser: `fully_shard` per transformer block, then the root.

NCCL on GPUs, gloo on CPU (the worker creates the process group). Blocks are
found by class name, from the recipe; a name that matches nothing is an error
(training silently unsharded is a known trap elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from unirl.types.constraints import AtLeastOne, check_fields

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelConfig:
    """`train.parallel`: the device mesh of a track's `num_devices` ranks (plain keys, no
    `_target_`; absent: plain FSDP over all ranks, no sequence parallelism).

    Attributes:
        replicate: HSDP replicas: the ranks form a 2-D mesh of `replicate` x `shard`; parameters,
            gradients and optimizer state are sharded along the second dimension and replicated
            along the first (gradients reduce-scattered within a replica group, then all-reduced
            across replicas). 1: plain FSDP over all ranks. A checkpoint written on one mesh
            resumes on another of the same world size (`torch.distributed.checkpoint` reshards).
        shard: the ranks each replica shards over; null: `num_devices / replicate`. replicate x
            shard must be `num_devices` (validated before Ray).
        sp: Ulysses sequence-parallel degree (`unirl.train.sequence_parallel`): groups of `sp`
            consecutive ranks share their samples and split each sample's tokens; 1: off. Must
            divide `num_devices` and the transformer's heads; SD3, FLUX.1, Wan, Qwen-Image and
            text-only causal LMs (their replay).
    """

    replicate: AtLeastOne = 1
    shard: AtLeastOne | None = None
    sp: AtLeastOne = 1

    def __post_init__(self) -> None:
        check_fields(self, "train.parallel.")

    @classmethod
    def of(cls, node: Any) -> ParallelConfig:
        """From a recipe's `train.parallel` mapping (None: the defaults); an unknown key is an
        error naming it and the valid ones."""
        node = dict(node or {})
        unknown = sorted(set(node) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"train.parallel: unknown key(s) {unknown}; valid keys: replicate, shard, sp")
        return cls(**node)


@dataclass
class FSDPConfig:
    """How the trainable module is sharded over the data-parallel ranks.

    Attributes:
        block_classes: class names of the blocks to shard one by one (SD3:
            `JointTransformerBlock`); the root is sharded last.
        param_dtype: compute dtype of the all-gathered parameters.
        reduce_dtype: dtype of the gradient reduce-scatter.
        reshard_after_forward: free gathered parameters after each forward
            (less memory, one more all-gather in backward).
        activation_checkpointing: recompute each block's activations in backward
            (applied on one rank too; the other fields only act when sharded).
        offload_params: FSDP2 parameter offload (`CPUOffloadPolicy`): the sharded parameters,
            their gradients and the optimizer state (AdamW steps on the CPU) live in host memory
            (pinned on a GPU); each unit's shards are copied to the device for its all-gather and
            freed after. The device then holds the gathered units, activations and the frozen
            modules. Module and stage `device` answer the device it computes on
            (`compute_device`), and a GPU worker's process group gets a gloo backend for the
            host tensors' collectives (gradient clipping). With one rank nothing is sharded, so
            nothing is offloaded (refused before Ray); on a CPU worker it changes nothing but
            runs FSDP2's offload path (the tests hold its math there).
    """

    block_classes: list[str] = field(default_factory=lambda: ["JointTransformerBlock"])
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    offload_params: bool = False

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in _DTYPES:
                raise ValueError(
                    f"train.fsdp.{key} must be one of {sorted(_DTYPES)}, got {getattr(self, key)!r}"
                )
        if not self.block_classes:
            raise ValueError("train.fsdp.block_classes must name at least one block class")


def unmatched_block_classes(module: torch.nn.Module, block_classes: list[str]) -> list[str]:
    """Names in `block_classes` that are the class of no submodule of `module`."""
    present = {type(m).__name__ for m in module.modules()}
    return [name for name in block_classes if name not in present]


def checkpoint_blocks(module: torch.nn.Module, block_classes: list[str]) -> int:
    """Wrap every `block_classes` block of `module` in activation checkpointing, in
    place (its activations are recomputed in backward instead of kept); returns the
    number of blocks wrapped. Works with or without sharding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    missing = unmatched_block_classes(module, block_classes)
    if missing:
        raise ValueError(
            f"train.fsdp.block_classes {missing} match no module of {type(module).__name__}: "
            "activation checkpointing would silently not happen"
        )
    names = set(block_classes)
    count = sum(type(m).__name__ in names for m in module.modules())
    apply_activation_checkpointing(module, check_fn=lambda m: type(m).__name__ in names)
    return count


def device_mesh(device_type: str, world: int, replicate: int = 1) -> DeviceMesh:
    """The data-parallel mesh: 1-D over `world` ranks (FSDP), or with `replicate` > 1 the 2-D
    ("replicate", "shard") mesh of replicate x world / replicate ranks (HSDP: `fully_shard` on a
    2-D mesh shards along "shard" and replicates along "replicate"). Ranks r = i * shard + j
    (replica i, shard j)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % replicate:
        raise ValueError(
            f"train.parallel.replicate={replicate} does not divide the {world} data-parallel ranks; "
            f"valid values: {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if replicate == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(
        device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def shard_module(
    module: torch.nn.Module,
    cfg: FSDPConfig,
    device_type: str,
    roots: tuple[str, ...] = (),
    replicate: int = 1,
) -> torch.nn.Module:
    """FSDP2 on `module` in place: `fully_shard` per block (the activation-checkpoint
    wrappers when `checkpoint_blocks` ran first), then the root; returns it.

    `roots`: for a model whose stages call submodules outside its own forward (Janus's image
    stage runs `language_model`, `generation_head`, ... directly), the names of those submodules
    (`submodule_named`): each is sharded as a root of its own after the blocks, and the whole
    model is not (FSDP2 gathers a unit's parameters in that unit's forward, and the first forward
    through a sub-unit would make it a root before the model's). Every trainable parameter must
    then lie in a block or a named root; frozen ones outside them stay whole on every rank.

    Requires an initialized default process group; the mesh spans all its ranks (`replicate` >
    1: HSDP's 2-D mesh, `device_mesh`).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    missing = unmatched_block_classes(module, cfg.block_classes)
    if missing:
        present = sorted({type(m).__name__ for m in module.modules() if "Block" in type(m).__name__})
        raise ValueError(
            f"train.fsdp.block_classes {missing} match no module of {type(module).__name__}; "
            f"block classes present: {present}"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    # each block is sharded as one unit with its checkpoint wrapper, if it has one
    blocks = [m for m in module.modules() if isinstance(m, CheckpointWrapper)] or [
        m for m in module.modules() if type(m).__name__ in set(cfg.block_classes)
    ]
    mesh = device_mesh(device_type, dist.get_world_size(), replicate)
    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[cfg.param_dtype], reduce_dtype=_DTYPES[cfg.reduce_dtype]
    )
    units = [submodule_named(module, name) for name in roots] or [module]
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if cfg.offload_params else OffloadPolicy()
    if cfg.offload_params:  # the parameters will report the host: say where every part computes
        device = next(module.parameters()).device
        for sub in module.modules():  # a bundle may hold a part (an expert) rather than the root
            sub.compute_device = device
    for unit in [*blocks, *units]:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=cfg.reshard_after_forward,
            offload_policy=offload,
        )
    if roots:
        from torch.distributed.tensor import DTensor

        outside = [n for n, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if outside:
            raise ValueError(
                f"{len(outside)} trainable parameters lie outside the FSDP roots {list(roots)} and the blocks "
                f"{cfg.block_classes} (e.g. {outside[:3]}): their gradients would not be reduced over the ranks"
            )
    return module


def submodule_named(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """The one submodule of `module` whose qualified name ends in the components `name`
    ("language_model" finds "base_model.model.model.language_model" inside a peft wrapper)."""
    parts = name.split(".")
    found = [m for q, m in module.named_modules() if q.split(".")[-len(parts) :] == parts]
    if len(found) != 1:
        raise ValueError(
            f"FSDP root {name!r}: {len(found)} submodules of {type(module).__name__} end in that name, "
            "it must name exactly one"
        )
    return found[0]
