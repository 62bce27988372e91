"""PPO's critic on a train rank: its value network (text: per-token values,
`unirl.models.causal_lm.value`; diffusion: per-SDE-step values, `unirl.models.flow.value`), its
own backend (optimizer, LR schedule, LoRA or full fine-tune, FSDP2) and the same mini-batch loop
as the policy (`TrainStack`).

It lives on the policy's workers (colocated: same devices, same ranks). The worker asks it for
the values of each rollout it samples (`attach_values`, before the track leaves the worker, so
the driver's GAE sees them), trains it on each step's track (`train`, before the policy's
update, as verl) and saves / loads its state beside the policy's (`save`, `load`: a `critic/`
directory in the checkpoint, same format).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from unirl.algorithms.advantages import token_inputs, track_value_targets
from unirl.algorithms.ppo import ValueLoss, ValueNorm
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.fsdp import FSDPConfig
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types.advantages import AdvantageConfig
from unirl.types.batch import even_chunks
from unirl.types.constraints import AtLeastOne, NonNegativeInt, Positive, check_fields
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


@dataclass
class CriticConfig:
    """`critic`: the value model and how it trains.

    Attributes:
        model: the value network's config, from the policy's family (the causal LM's:
            `unirl.models.qwen.QwenValueConfig`); it has `build_value_stage()`
            and `trainable_on_meta()`.
        optim: its AdamW and LR schedule (verl: lr about 10x the actor's).
        lora: LoRA on its backbone (the value head is trained whole), or null for a full fine-tune.
        fsdp: FSDP2 settings when num_devices > 1.
        warmup_steps: steps at the start of the run that train only the critic (the policy is
            frozen: no policy update); must be < num_steps.
        cliprange_value: c of the clipped value loss (`unirl.algorithms.ppo.ValueLoss`).
        loss_agg_mode: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum".
        epochs: the critic's passes over each rollout (verl's critic.ppo_epochs); null: the
            policy's `train.stack.num_updates_per_batch`.
        value_norm_beta: the critic learns normalized returns under running statistics with
            this decay per step (`unirl.algorithms.ppo.ValueNorm`, in (0, 1)); null: raw returns.
    The critic otherwise trains with the policy's `train.stack` geometry (micro-batches,
    mini-batches).
    """

    model: Any
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0))
    lora: LoRAConfig | None = None
    fsdp: FSDPConfig | None = None
    warmup_steps: NonNegativeInt = 0
    cliprange_value: Positive = 0.5
    loss_agg_mode: str = "token-mean"
    epochs: AtLeastOne | None = None
    value_norm_beta: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, "critic.")
        if self.value_norm_beta is not None:
            ValueNorm(self.value_norm_beta)  # range-checks it


class Critic:
    """The critic of one train rank (see the module docstring).

    Args:
        cfg: the recipe's `critic`.
        stack: the policy's `train.stack` (the critic's batch geometry; `cfg.epochs` replaces
            its passes).
        advantage: the run's advantage settings (the value targets are its GAE returns).
        total_steps: the policy's optimizer steps of the run (the LR schedule's length, scaled
            by epochs / the policy's passes when `cfg.epochs` is set).
        device: where it computes.
        policy: the policy's stage (a diffusion critic reads its dimensions from it).
    """

    def __init__(
        self,
        cfg: CriticConfig,
        stack: TrainStackConfig,
        advantage: AdvantageConfig,
        total_steps: int,
        device: torch.device,
        policy: Any = None,
    ) -> None:
        self.config = cfg
        self.stage = cfg.model.build_value_stage(policy).to(device)
        if cfg.epochs is not None:
            total_steps = total_steps * cfg.epochs // stack.num_updates_per_batch
        lora = cfg.lora
        if lora is not None:  # the head is new: it trains whole, beside the backbone's adapters
            lora = dataclasses.replace(lora, modules_to_save=[*lora.modules_to_save, cfg.model.head_name])
        self.backend = TrainBackend(self.stage.module, lora, cfg.optim, total_steps, fsdp=cfg.fsdp)
        self.stage.module = self.backend.module
        norm = ValueNorm(cfg.value_norm_beta) if cfg.value_norm_beta is not None else None
        self.loss = ValueLoss(advantage, cfg.cliprange_value, cfg.loss_agg_mode, norm)
        if cfg.epochs is not None:
            stack = dataclasses.replace(stack, num_updates_per_batch=cfg.epochs)
        self.stack = TrainStack(self.stage, self.backend, self.loss, stack)

    @torch.no_grad()
    def attach_values(self, track: RolloutTrack) -> None:
        """Set `track.segment.values`: the critic's values of the sampled responses (a text
        track: per sample [R_i]) or of the states before the SDE steps (a diffusion track:
        [B, K]), in forwards of `micro_batch_size` samples."""
        seg, size = track.segment, self.stack.config.micro_batch_size
        self.stage.module.eval()
        chunks = even_chunks(len(track), -(-len(track) // size))
        try:
            parts = [self.loss.raw(self.stage.values(track.select(idx))) for idx in chunks]
        finally:
            self.stage.module.train()
        if isinstance(seg, TokenSegment):  # jagged: each response's own length
            seg.values = [
                part[i, : seg.response_ids[j].numel()].clone()
                for idx, part in zip(chunks, parts, strict=True)
                for i, j in enumerate(idx)
            ]
        else:
            seg.values = torch.cat(parts)

    def train(self, track: RolloutTrack, progress: float) -> dict[str, float]:
        """One step's critic updates on `track` (rewards and the rollout's values set); its metrics
        as `critic/...`: the stack's (`vf_loss`, `vf_clipfrac`, `vpred_mean`, `train/grad_norm`,
        `train/lr`, ...), with a `ValueNorm` its `norm_mean` / `norm_std`, and, over this rank's response tokens (SDE steps) before the updates,
        the returns' and rollout values' means and `vf_explained_var` = 1 - Var(R - V) / Var(R)."""
        inputs = token_inputs(track, self.loss.advantage)
        mask = inputs["mask"].bool()
        returns = track_value_targets(track, self.loss.advantage)[mask]
        values = inputs["values"][mask]
        var = returns.var(unbiased=False)
        explained = float(1 - (returns - values).var(unbiased=False) / var) if var > 0 else 0.0
        if self.loss.norm is not None:
            self.loss.norm.update(returns)
        metrics = self.stack.train_track(track, progress)
        out = {f"critic/{k}": v for k, v in metrics.items()}
        if self.loss.norm is not None:
            out.update({"critic/norm_mean": self.loss.norm.mean, "critic/norm_std": self.loss.norm.std})
        out.update(
            {
                "critic/returns_mean": float(returns.mean()),
                "critic/values_mean": float(values.mean()),
                "critic/vf_explained_var": explained,
            }
        )
        return out

    def save(self, path: str, rank: int) -> None:
        """Write this rank's critic state under `path/critic` (collective when sharded)."""
        save_train_state(os.path.join(path, "critic"), self.backend, rank, self.loss)

    def load(self, path: str, rank: int) -> None:
        """Restore what `save` wrote (collective when sharded)."""
        load_train_state(os.path.join(path, "critic"), self.backend, rank, self.loss)
