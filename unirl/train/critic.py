"""PPO's critic on a train rank: its value network, its own backend (optimizer, LR schedule,
LoRA or full fine-tune, FSDP2) and the same mini-batch loop as the policy (`TrainStack`).

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

from unirl.algorithms.ppo import ValueLoss
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.fsdp import FSDPConfig
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types.advantages import AdvantageConfig
from unirl.types.batch import even_chunks
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class CriticConfig:
    """`critic`: the value model and how it trains.

    Attributes:
        model: the value network's config, from the policy's family (the causal LM's:
            `unirl.models.causal_lm.value.CausalLMValueConfig`); it has `build_value_stage()`
            and `trainable_on_meta()`.
        optim: its AdamW and LR schedule (verl: lr about 10x the actor's).
        lora: LoRA on its backbone (the value head is trained whole), or null for a full fine-tune.
        fsdp: FSDP2 settings when num_devices > 1.
        warmup_steps: steps at the start of the run that train only the critic (the policy is
            frozen: no policy update); must be < num_steps.
        cliprange_value: c of the clipped value loss (`unirl.algorithms.ppo.ValueLoss`).
        loss_agg_mode: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum".
    The critic trains with the policy's `train.stack` geometry (micro-batches, passes, mini-batches).
    """

    model: Any
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0))
    lora: LoRAConfig | None = None
    fsdp: FSDPConfig | None = None
    warmup_steps: int = 0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.cliprange_value > 0:
            raise ValueError(f"critic.cliprange_value must be > 0, got {self.cliprange_value}")


class Critic:
    """The critic of one train rank (see the module docstring).

    Args:
        cfg: the recipe's `critic`.
        stack: the policy's `train.stack` (the critic's batch geometry).
        advantage: the run's advantage settings (the value targets are its GAE returns).
        total_steps: optimizer steps of the run (LR schedule length).
        device: where it computes.
    """

    def __init__(
        self,
        cfg: CriticConfig,
        stack: TrainStackConfig,
        advantage: AdvantageConfig,
        total_steps: int,
        device: torch.device,
    ) -> None:
        self.config = cfg
        self.stage = cfg.model.build_value_stage().to(device)
        lora = cfg.lora
        if lora is not None:  # the head is new: it trains whole, beside the backbone's adapters
            lora = dataclasses.replace(lora, modules_to_save=[*lora.modules_to_save, cfg.model.head_name])
        self.backend = TrainBackend(self.stage.module, lora, cfg.optim, total_steps, fsdp=cfg.fsdp)
        self.stage.module = self.backend.module
        self.loss = ValueLoss(advantage, cfg.cliprange_value, cfg.loss_agg_mode)
        self.stack = TrainStack(self.stage, self.backend, self.loss, stack)

    @torch.no_grad()
    def attach_values(self, track: RolloutTrack) -> None:
        """Set `track.segment.values`: the critic's values of the sampled responses (forwards of
        `micro_batch_size` samples)."""
        seg, size = track.segment, self.stack.config.micro_batch_size
        self.stage.module.eval()
        try:
            rows = []
            for idx in even_chunks(len(track), -(-len(track) // size)):
                part = track.select(idx).segment
                values = self.stage.token_values(part)
                rows += [values[i, : r.numel()].clone() for i, r in enumerate(part.response_ids)]
        finally:
            self.stage.module.train()
        seg.values = rows

    def train(self, track: RolloutTrack, progress: float) -> dict[str, float]:
        """One step's critic updates on `track` (rewards and the rollout's values set); its metrics
        as `critic/...`: the stack's (`vf_loss`, `vf_clipfrac`, `vpred_mean`, `train/grad_norm`,
        `train/lr`, ...) and, over this rank's response tokens before the updates, the returns'
        and rollout values' means and `vf_explained_var` = 1 - Var(R - V) / Var(R)."""
        mask = track.segment.response_mask().bool()
        returns = track.value_targets(self.loss.advantage)[mask]
        values = track.segment.padded("values").float()[mask]
        var = returns.var(unbiased=False)
        explained = float(1 - (returns - values).var(unbiased=False) / var) if var > 0 else 0.0
        metrics = self.stack.train_track(track, progress)
        out = {f"critic/{k}": v for k, v in metrics.items()}
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
        save_train_state(os.path.join(path, "critic"), self.backend, rank)

    def load(self, path: str, rank: int) -> None:
        """Restore what `save` wrote (collective when sharded)."""
        load_train_state(os.path.join(path, "critic"), self.backend, rank)
