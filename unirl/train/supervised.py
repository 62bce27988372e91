"""The resumable supervised loop every SFT run shares (flow matching, causal LM).

A run subclasses `SupervisedRun` and implements `batch_loss()` (draw a batch from
`self.rng` / `self.gen`, return the scalar loss and extra per-step counters); the
base owns the AdamW optimizer and LR schedule, gradient clipping with non-finite
steps skipped, the atomic `sft_state.pt` (weights, optimizer, schedule, every RNG,
step), the log with its resume rule, evaluation, and the wall-clock-bounded loop.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from unirl.tracking.trackers import Tracking
from unirl.train.backend import LRSchedule, lr_factor
from unirl.types.constraints import AtLeastOne, NonNegative, NonNegativeInt, Positive, check_fields


@dataclass
class SupervisedConfig:
    """The settings every supervised run shares (the recipe's `sft` node); a run's config
    subclasses it, adds its own fields, and may change the defaults.

    Attributes:
        num_steps: optimizer steps in total (a resumed run continues to it).
        batch_size: examples per step.
        lr, weight_decay, warmup_steps, lr_schedule, max_grad_norm: AdamW and its schedule.
        checkpoint_every: steps between resumable state saves.
        eval_every: steps between evaluations (0 disables).
        log_every: steps between log rows.
        seed: data (and noise) seed.

    Ranges are declared in the fields' types (`unirl.types.constraints`); a subclass that
    overrides a field's default restates its type, and `__post_init__` checks every field.
    """

    num_steps: AtLeastOne = 1000
    batch_size: AtLeastOne = 32
    lr: Positive = 1e-3
    weight_decay: NonNegative = 0.0
    warmup_steps: NonNegativeInt = 0
    lr_schedule: LRSchedule = "constant"
    max_grad_norm: Positive = 1.0
    checkpoint_every: AtLeastOne = 250
    eval_every: NonNegativeInt = 0
    log_every: AtLeastOne = 25
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "sft.")


class SupervisedRun(ABC):
    """Base of a supervised run over `modules` with settings `cfg`.

    `cfg` has `num_steps, lr, weight_decay, lr_schedule, warmup_steps,
    max_grad_norm, seed, log_every, eval_every, checkpoint_every`. `rng` (numpy)
    draws data, `gen` (torch, CPU) draws noise; both are seeded by `cfg.seed`
    and saved with the state, so a resumed run continues identically.

    Args:
        modules: the trained modules (all their parameters are trained).
        cfg: run settings.
        out_dir: where `sft_state.pt` and the log (`log_name`) go.
        evaluate: optional `evaluate(target) -> dict[str, float]`, run with the
            modules in eval mode every `eval_every` steps and at the end; logged
            as `eval/<key>`.
        eval_target: what `evaluate` is called with (a bundle).
    """

    log_name = "metrics.jsonl"

    def __init__(
        self,
        modules: list[torch.nn.Module],
        cfg: Any,
        out_dir: str,
        evaluate: Callable[[Any], dict[str, float]] | None = None,
        eval_target: Any = None,
    ) -> None:
        self.modules, self.cfg, self.out = modules, cfg, out_dir
        self.evaluate, self.eval_target = evaluate, eval_target
        for m in modules:
            m.requires_grad_(True).train()
        self.params = [q for m in modules for q in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg.lr_schedule, s, cfg.num_steps, cfg.warmup_steps)
        )
        self.step = 0
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        os.makedirs(out_dir, exist_ok=True)
        self.state_path = os.path.join(out_dir, "sft_state.pt")
        self.log_path = os.path.join(out_dir, self.log_name)

    @abstractmethod
    def batch_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """Draw one batch and return (scalar loss with grad, extra counters, e.g. `tokens`)."""

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step on a fresh batch (skipped when the gradient norm is not finite);
        returns its loss, grad norm, lr, `skipped` and the run's extra counters."""
        loss, extra = self.batch_loss()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "loss": float(loss.detach()),
            "grad_norm": norm,
            "lr": lr,
            "skipped": float(not math.isfinite(norm)),
            **extra,
        }

    # ---- state ------------------------------------------------------------------------------
    def save_state(self) -> None:
        """Write `sft_state.pt` atomically (weights, optimizer, schedule, RNGs, step)."""
        state = {
            "step": self.step,
            "modules": [m.state_dict() for m in self.modules],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": self.rng.bit_generator.state,
            "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        tmp = self.state_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def load_state(self) -> bool:
        """Resume from `sft_state.pt` if present; returns whether it did.

        Log rows past the saved step (logged after the last checkpoint by a run
        that was then stopped), and a final-eval row, are dropped: the resumed
        run logs them again.
        """
        if not os.path.exists(self.state_path):
            return False
        state = torch.load(self.state_path, weights_only=False, map_location="cpu")
        for m, sd in zip(self.modules, state["modules"], strict=True):
            m.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.bit_generator.state = state["rng"]
        self.gen.set_state(state["gen"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = int(state["step"])
        if os.path.exists(self.log_path):
            with open(self.log_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            keep = [r for r in rows if r["step"] <= self.step and not r.get("final")]
            if len(keep) != len(rows):
                with open(self.log_path + ".tmp", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in keep)
                os.replace(self.log_path + ".tmp", self.log_path)
        return True

    def _eval(self) -> dict[str, float]:
        for m in self.modules:
            m.eval()
        try:
            return {f"eval/{k}": v for k, v in self.evaluate(self.eval_target).items()}
        finally:
            for m in self.modules:
                m.train()

    # ---- the loop ---------------------------------------------------------------------------
    before_step: Callable[[], object] | None = (
        None  # called as each step starts (train_sft: the thread count)
    )

    def run(self, max_seconds: float | None = None, recipe: DictConfig | None = None) -> list[dict[str, Any]]:
        """Train to `num_steps` (or until `max_seconds` of wall clock pass), logging and
        saving resumable state; returns the rows written.

        A log row every `log_every` steps holds the window's mean loss, the lr of its
        last step, `step_s` (mean seconds per step) and, when `batch_loss` counts
        `tokens`, `tokens_per_s` (tokens trained per second of training). Rows go to the log
        (`log_name`) and, given the `recipe`, to the trackers of its `tracking` list, started
        with the resolved recipe as run metadata (`unirl.tracking.trackers.Tracking`, as the RL
        trainers').
        """
        cfg = self.cfg
        self.load_state()
        if recipe is not None:
            log = Tracking.from_recipe(self.out, recipe, self.log_name)
        else:
            log = Tracking.start(self.out, None, {}, self.log_name)
        rows: list[dict[str, Any]] = []
        losses: list[float] = []
        tokens, seconds, t_start = 0.0, 0.0, time.perf_counter()
        try:
            while self.step < cfg.num_steps:
                t0 = time.perf_counter()
                if self.before_step is not None:  # e.g. the thread governor's count for the whole step
                    self.before_step()
                m = self.train_step()
                seconds += time.perf_counter() - t0
                losses.append(m["loss"])
                tokens += m.get("tokens", 0.0)
                row: dict[str, Any] | None = None
                if self.step % cfg.log_every == 0:
                    row = {
                        "step": self.step,
                        "loss": sum(losses) / len(losses),
                        "lr": m["lr"],
                        "step_s": seconds / len(losses),
                    }
                    if "tokens" in m:
                        row["tokens_per_s"] = tokens / seconds
                    losses, tokens, seconds = [], 0.0, 0.0
                if self.evaluate is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                    row = (row or {"step": self.step}) | self._eval()
                if row is not None:
                    log.log(row)
                    rows.append(row)
                if self.step % cfg.checkpoint_every == 0:
                    self.save_state()
                if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                    break
            self.save_state()
            if self.evaluate is not None and self.step >= cfg.num_steps:
                row = {"step": self.step, "final": True} | self._eval()
                log.log(row)
                rows.append(row)
        finally:
            log.close()
        return rows
