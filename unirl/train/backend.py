"""The train backend: owns the trainable module, LoRA, FSDP2, optimizer, schedule and EMA.

One backend per trainable module, one per rank. It injects LoRA (peft, through
diffusers' adapter API) or trains all weights, shards the module with FSDP2
when the run has several ranks, builds AdamW and the LR schedule, clips
gradients across shards, and skips the optimizer step when the gradient norm
is not finite. Methods marked *collective* must run on every rank at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from annotated_types import Interval

from unirl.models.weights import swapped_weights
from unirl.train.ema import EMA, EMAConfig
from unirl.train.fsdp import FSDPConfig, ParallelConfig, checkpoint_blocks, shard_module
from unirl.types.constraints import AtLeastOne, NonNegative, NonNegativeInt, Positive, check_fields

LRSchedule = Literal["constant", "linear", "cosine"]


@dataclass
class LoRAConfig:
    """LoRA on the denoiser via peft. `target_modules` are module-name suffixes;
    `modules_to_save` names modules trained whole beside the adapters (peft's key: a
    critic's new value head)."""

    rank: AtLeastOne = 8
    alpha: Positive = 16.0
    dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init_lora_weights: bool | str = True
    modules_to_save: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_fields(self, "train.lora.")
        if not self.target_modules:
            raise ValueError("train.lora.target_modules must name at least one module suffix")


@dataclass
class OptimConfig:
    """AdamW, LR schedule and gradient clipping.

    Attributes:
        lr, betas, weight_decay, eps: AdamW.
        lr_schedule: "constant", "linear" (decay to 0) or "cosine" (to 0),
            over `total_steps` optimizer steps after `warmup_steps` linear warm-up.
        max_grad_norm: clip the global grad norm; a non-finite norm skips the step.
    """

    lr: Positive = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: NonNegative = 1e-4
    eps: Positive = 1e-8
    lr_schedule: LRSchedule = "constant"
    warmup_steps: NonNegativeInt = 0
    max_grad_norm: Positive = 1.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        check_fields(self, "train.optim.")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.optim.betas must both be in [0, 1), got {list(self.betas)}")


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lora_target_problem(
    module: torch.nn.Module, targets: list[str], key: str = "train.lora.target_modules"
) -> str | None:
    """Why `targets` (module-name suffixes, peft's matching) cannot all be LoRA targets of
    `module`, naming `key` and the linear-layer names that do exist; None when every target
    matches a module. Works on a meta-device module tree (validation reads no weights)."""
    names = [n for n, _ in module.named_modules()]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return None
    linear = sorted(
        {
            ".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
            for n, m in module.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    return (
        f"{key} {unmatched} match no module of {type(module).__name__}; its linear layers are named "
        f"{linear} (give name suffixes)"
    )


def inject_lora(module: torch.nn.Module, cfg: LoRAConfig) -> None:
    """Freeze `module` and add a peft LoRA adapter ("default") on the modules named by
    `cfg.target_modules` (name suffixes); a suffix matching no module is an error. The
    train backend and a dedicated rollout engine inject the same adapter this way, so
    the engine's module has the trainer's parameter names."""
    from peft import LoraConfig

    problem = lora_target_problem(module, cfg.target_modules)
    if problem:
        raise ValueError(problem)
    module.requires_grad_(False)
    module.add_adapter(
        LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=list(cfg.target_modules),
            init_lora_weights=cfg.init_lora_weights,
            modules_to_save=list(cfg.modules_to_save) or None,
        )
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a plain tensor or a DTensor (collective for DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _unwrapped_name(name: str) -> str:
    """Parameter name without activation-checkpoint wrapper segments."""
    return name.replace("_checkpoint_wrapped_module.", "")


class TrainBackend:
    """Owns the trainable module and its optimizer state on one rank.

    Args:
        module: the denoiser to train, on its device (modified in place: LoRA
            is injected, blocks are wrapped in activation checkpointing when
            `fsdp.activation_checkpointing`, then it is sharded when the default
            process group has > 1 rank). Every state the backend keeps (optimizer
            moments, EMA shadow, reference copy) lives on the module's device.
        lora: LoRA config, or None for a full fine-tune.
        optim: optimizer config.
        total_steps: optimizer steps of the run (for LR schedules).
        fsdp: FSDP2 config; required when the world size is > 1.
        ema: EMA config, or None.
        snapshots: named EMAs a loss evaluates (`StageAlgorithm.snapshots`: DGPO's fast EMA
            reference, CRD's old snapshot), each updated at its `update_on`, run with
            `snapshot_weights(name)` and saved with the train state.
        keep_reference: keep the reference policy available (`reference()`):
            free with LoRA (adapters disabled); a full fine-tune keeps a copy
            of the initial (sharded) weights.
        writer: the model family's exporter, `writer(path, kind, state, module)`
            with kind "lora" (peft state dict) or "full" (the module's full state
            dict), both unsharded on the CPU; `module` is the trained (wrapped)
            module (its `peft_config`, its class and config). Needed by `save_weights`.
        frozen: names of submodules no loss reaches (a unified model's VQ-VAE and
            understanding tower): their parameters, and LoRA adapters inside them, stay
            frozen, so the optimizer holds state only for what trains. A name matches a
            whole component of a parameter's path ("vqmodel" matches "model.vqmodel.x").
        roots: with several ranks, the submodules sharded as FSDP roots of their own instead of
            the whole module (`shard_module`): a unified model's stages call them directly.
        parallel: the device mesh (`ParallelConfig`: HSDP replicas, Ulysses degree); None: plain
            FSDP over all ranks.
        groups_share_samples: the caller gives every group of `parallel.sp` consecutive ranks the
            same samples, as sequence parallelism needs (`unirl.train.sequence_parallel`); without
            it `parallel.sp > 1` is refused.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        lora: LoRAConfig | None,
        optim: OptimConfig,
        total_steps: int,
        fsdp: FSDPConfig | None = None,
        ema: EMAConfig | None = None,
        snapshots: dict[str, EMAConfig] | None = None,
        keep_reference: bool = False,
        writer: Callable[[str, str, dict[str, torch.Tensor], torch.nn.Module], None] | None = None,
        frozen: tuple[str, ...] = (),
        roots: tuple[str, ...] = (),
        parallel: ParallelConfig | None = None,
        groups_share_samples: bool = False,
    ) -> None:
        self.module = module
        self.writer = writer
        self.lora = lora
        self.optim_cfg = optim
        if lora is not None:
            self._inject_lora(lora)
        else:
            module.requires_grad_(True)
        for name, param in module.named_parameters():
            if set(name.split(".")) & set(frozen):
                param.requires_grad_(False)
        world = dist.get_world_size() if dist.is_initialized() else 1
        parallel = parallel or ParallelConfig()
        if world > 1 and parallel.sp > 1:
            from unirl.train.sequence_parallel import enable_ulysses

            if not groups_share_samples:
                raise ValueError(
                    f"train.parallel.sp={parallel.sp}: sequence parallelism runs in single-track recipes only "
                    "(their driver gives each group of sp ranks one sample shard); set it to 1 here"
                )
            from unirl.train.sequence_parallel import is_causal_lm

            if fsdp is not None and fsdp.activation_checkpointing and is_causal_lm(module):
                raise ValueError(
                    f"train.parallel.sp={parallel.sp} with train.fsdp.activation_checkpointing=true on a causal "
                    "LM: the recomputed attention would run outside the sharded replay; set one of them off"
                )
            # before the checkpoint wrappers: the plan's hooks find a block's inputs by their names
            enable_ulysses(module, parallel.sp)
        if fsdp is not None and fsdp.activation_checkpointing:
            checkpoint_blocks(module, fsdp.block_classes)
        if world > 1:
            if fsdp is None:
                raise ValueError(f"{world} data-parallel ranks need train.fsdp (FSDP2 sharding settings)")
            shard_module(module, fsdp, next(module.parameters()).device.type, roots, parallel.replicate)
        self.sharded = world > 1
        # Ulysses groups: FSDP averages gradients over all ranks, but a group's ranks hold partial
        # gradients of the same samples whose sum is theirs: the train stack scales losses by this
        self.loss_multiplier = float(parallel.sp) if world > 1 else 1.0
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        if not self.params:
            raise ValueError(
                "the train backend found no trainable parameters (check train.lora.target_modules)"
            )
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, eps=optim.eps
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(optim.lr_schedule, s, total_steps, optim.warmup_steps)
        )
        self.ema = EMA(self.named_params, ema) if ema is not None else None
        self.snapshots = {name: EMA(self.named_params, cfg) for name, cfg in (snapshots or {}).items()}
        self._reference: list[torch.Tensor] | None = None
        if keep_reference and lora is None:
            self._reference = [p.detach().clone() for p in self.params]
        self.optimizer_steps = 0
        self.skipped_steps = 0

    def _inject_lora(self, cfg: LoRAConfig) -> None:
        inject_lora(self.module, cfg)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the module as the reference policy: LoRA disabled, or (full
        fine-tune) the initial weights swapped in and restored after."""
        if self.lora is not None:
            self.module.disable_adapters()
            try:
                yield
            finally:
                self.module.enable_adapters()
            return
        if self._reference is None:
            raise RuntimeError(
                "this backend keeps no reference weights: construct it with keep_reference=True"
            )
        with swapped_weights(self.params, self._reference, self.module):
            yield

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Run the module with its EMA weights (sampling, eval); restored after."""
        if self.ema is None:
            raise RuntimeError("no EMA configured: set train.ema in the recipe")
        with self.ema.swap(fsdp_module=self.module):
            yield

    @contextlib.contextmanager
    def snapshot_weights(self, name: str) -> Iterator[None]:
        """Run the module with the snapshot `name`'s weights; restored after."""
        with self.snapshots[name].swap(fsdp_module=self.module):
            yield

    def _update_emas(self, when: str) -> None:
        for ema in [self.ema, *self.snapshots.values()]:
            if ema is not None and ema.config.update_on == when:
                ema.update()

    def move_optimizer_state(self, device: str | torch.device) -> None:
        """Move optimizer state tensors (Adam moments) to `device`, e.g. to "cpu"
        around a rollout and back to the parameters' device before training. A
        no-op when they are already there (always so on CPU-only runs)."""
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    @contextlib.contextmanager
    def optimizer_offloaded(self) -> Iterator[None]:
        """Optimizer state on the CPU for the body (rollout), back on the parameters' device after."""
        device = self.params[0].device
        self.move_optimizer_state("cpu")
        try:
            yield
        finally:
            self.move_optimizer_state(device)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        """Clip (global norm across shards), then step, or skip on a non-finite
        norm. Updates the EMA when it follows optimizer steps. Collective when sharded."""
        norm = float(_full(torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.max_grad_norm)))
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self._update_emas("optimizer_step")
        else:
            self.skipped_steps += 1
        self.zero_grad()
        return {"train/grad_norm": norm, "train/lr": lr, "train/skipped_step": float(not finite)}

    def end_of_rollout(self) -> None:
        """Hook after a rollout's training: updates the EMA and snapshots that follow rollouts."""
        self._update_emas("rollout")

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sharded train state for `torch.distributed.checkpoint` (trainable params
        only, optimizer, scheduler, EMA, counters). Collective when sharded."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.module, self.optimizer, options=StateDictOptions(ignore_frozen_params=True)
        )
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "counters": {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps},
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.snapshots:
            state["snapshots"] = {name: ema.state_dict() for name, ema in self.snapshots.items()}
        if self._reference is not None:
            state["reference"] = {n: r for (n, _), r in zip(self.named_params, self._reference, strict=True)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (after `torch.distributed.checkpoint.load` filled it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["counters"]["optimizer_steps"])
        self.skipped_steps = int(state["counters"]["skipped_steps"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        for name, ema in self.snapshots.items():
            ema.load_state_dict(state["snapshots"][name])
        if self._reference is not None:
            with torch.no_grad():
                for (n, _), r in zip(self.named_params, self._reference, strict=True):
                    r.copy_(state["reference"][n])

    def full_trainable_state(self) -> dict[str, torch.Tensor]:
        """Consolidated (unsharded, CPU) trainable weights by their unwrapped
        names (as the bare module names them). Collective when sharded."""
        return {_unwrapped_name(n): _full(p.detach()).cpu() for n, p in self.named_params}

    def save_weights(self, path: str, base_model: str | None, write: bool = True) -> None:
        """Export the trained weights through the family's `writer` (a LoRA adapter or
        the full model, in the format its library loads directly), plus
        `unirl_checkpoint.json` naming the base model. Collective when sharded
        (every rank gathers; only ranks with `write` write)."""
        if self.writer is None:
            raise ValueError(
                "TrainBackend.save_weights needs the model family's writer (TrainBackend(writer=...))"
            )
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            # peft finds LoRA layers by module name: give it the module's own (wrapped) names, then unwrap
            gathered = {n: _full(p.detach()).cpu() for n, p in self.named_params}
            lora = get_peft_model_state_dict(self.module, state_dict=gathered)
            state = {_unwrapped_name(k): v for k, v in lora.items()}
            kind = "lora"
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            state = {_unwrapped_name(k): v for k, v in full.items()}
            kind = "full"
        if not write:
            return
        os.makedirs(path, exist_ok=True)
        self.writer(path, kind, state, self.module)
        with open(os.path.join(path, "unirl_checkpoint.json"), "w") as f:
            json.dump(
                {"kind": kind, "base_model": base_model, "optimizer_steps": self.optimizer_steps}, f, indent=2
            )
