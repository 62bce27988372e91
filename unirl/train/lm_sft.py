"""Supervised training of a causal LM on (prompt, completion) pairs (pretraining / the SFT stage).

Loss: token cross-entropy of the completion followed by the tokenizer's EOS, given the
prompt; prompt and padding positions are masked out, and the mean is over the batch's
completion (+ EOS) tokens. A prompt is tokenized exactly as `CausalLMStage.encode_prompts`
does with `chat_template: false` (`tokenizer(text, add_special_tokens=False)`) and the
completion separately after it, so a supervised model and the RL rollouts that start from
it see the same token sequences, and a sampled response ends at the EOS it was taught.
The run is resumable from its `sft_state.pt`.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from unirl.models.causal_lm.bundle import CausalLMBundle
from unirl.train.backend import LR_SCHEDULES, lr_factor

IGNORE_INDEX = -100


@dataclass
class CausalLMSFTConfig:
    """Settings of a supervised causal-LM run.

    Attributes:
        num_steps: optimizer steps in total (a resumed run continues to it).
        batch_size: (prompt, completion) pairs per step.
        lr, weight_decay, warmup_steps, lr_schedule, max_grad_norm: AdamW and its schedule.
        checkpoint_every: steps between resumable state saves.
        eval_every: steps between evaluations (0 disables).
        log_every: steps between log rows.
        seed: data seed.
    """

    num_steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    lr_schedule: str = "cosine"
    max_grad_norm: float = 1.0
    checkpoint_every: int = 250
    eval_every: int = 500
    log_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"sft.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        for key in ("num_steps", "batch_size", "checkpoint_every", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"sft.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("weight_decay", "warmup_steps", "eval_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"sft.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("lr", "max_grad_norm"):
            if not getattr(self, key) > 0:
                raise ValueError(f"sft.{key} must be > 0, got {getattr(self, key)}")


class TextPairSource(Protocol):
    """Supervised text: `sample_batch(n, rng) -> [(prompt, completion)] * n`."""

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple[str, str]]: ...


def encode_pairs(
    tokenizer: Any, pairs: list[tuple[str, str]], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize (prompt, completion) pairs into one right-padded batch.

    Row i is prompt_i + completion_i + [EOS] (prompt and completion each through
    `tokenizer(text, add_special_tokens=False)`, as rollouts tokenize prompts).

    Returns (input_ids [B, L] long, padded with the pad id; attention_mask [B, L] long;
    labels [B, L] long: the token at completion and EOS positions, IGNORE_INDEX at prompt
    and padding positions). A row longer than `max_positions` is an error naming it.
    """
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    rows, labels = [], []
    for (prompt, completion), p, c in zip(pairs, prompts, completions, strict=True):
        if not p:
            raise ValueError(f"the prompt of pair {(prompt, completion)!r} is empty (0 tokens)")
        seq = p + c + [tokenizer.eos_token_id]
        if len(seq) > max_positions:
            raise ValueError(
                f"pair {(prompt, completion)!r} is {len(seq)} tokens with EOS, more than the model's "
                f"max_position_embeddings ({max_positions}); shorten the data or enlarge the model"
            )
        rows.append(seq)
        labels.append([IGNORE_INDEX] * len(p) + c + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    target = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        target[i, : len(r)] = torch.tensor(lab)
    return input_ids, mask, target


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 mean cross-entropy of `labels[:, 1:]` under `logits[:, :-1]` ([B, L, V]) over the
    positions whose label is not IGNORE_INDEX (position t predicts token t + 1)."""
    pred = logits[:, :-1].float()
    return F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


class CausalLMSFT:
    """Trains `bundle.model` on `data` with `completion_loss` (full fine-tune, AdamW).

    Args:
        bundle: the causal LM and its tokenizer, on the device to train on.
        data: the supervised (prompt, completion) source, drawn from a seeded numpy generator.
        cfg: run settings.
        output_dir: where `sft_state.pt` (resumable) and `metrics.jsonl` go.
        evaluator: optional `evaluator(bundle) -> dict[str, float]` run every `eval_every`
            steps and at the end (e.g. `LMEvaluator`); its numbers go into the log as `eval/<key>`.
    """

    def __init__(
        self,
        bundle: CausalLMBundle,
        data: TextPairSource,
        cfg: CausalLMSFTConfig,
        output_dir: str,
        evaluator: Callable[[CausalLMBundle], dict[str, float]] | None = None,
    ) -> None:
        if not isinstance(bundle, CausalLMBundle):
            raise TypeError(
                f"CausalLMSFT trains a causal LM (model: unirl.models.causal_lm.CausalLMConfig), "
                f"got {type(bundle).__name__}"
            )
        self.bundle, self.data, self.cfg, self.out, self.evaluator = bundle, data, cfg, output_dir, evaluator
        self.model = bundle.model.requires_grad_(True).train()
        self.max_positions: int = self.model.config.max_position_embeddings
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg.lr_schedule, s, cfg.num_steps, cfg.warmup_steps)
        )
        self.step = 0
        self.rng = np.random.default_rng(cfg.seed)
        os.makedirs(output_dir, exist_ok=True)
        self.state_path = os.path.join(output_dir, "sft_state.pt")
        self.log_path = os.path.join(output_dir, "metrics.jsonl")

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step on a fresh batch; returns its loss, grad norm, lr and token count."""
        pairs = self.data.sample_batch(self.cfg.batch_size, self.rng)
        input_ids, mask, labels = encode_pairs(self.bundle.tokenizer, pairs, self.max_positions)
        device = self.bundle.device
        logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        loss = completion_loss(logits, labels.to(device))
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
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
            "tokens": float(mask.sum()),
            "skipped": float(not math.isfinite(norm)),
        }

    # ---- state ------------------------------------------------------------------------------
    def save_state(self) -> None:
        """Write `sft_state.pt` atomically (weights, optimizer, schedule, RNGs, step)."""
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": self.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        tmp = self.state_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def load_state(self) -> bool:
        """Resume from `sft_state.pt` if present; returns whether it did.

        Rows of `metrics.jsonl` past the saved step (logged after the last checkpoint
        by a run that was then stopped), and a final-eval row, are dropped: the
        resumed run logs them again.
        """
        if not os.path.exists(self.state_path):
            return False
        state = torch.load(self.state_path, weights_only=False, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.bit_generator.state = state["rng"]
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
        self.model.eval()
        try:
            return {f"eval/{k}": v for k, v in self.evaluator(self.bundle).items()}
        finally:
            self.model.train()

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, max_seconds: float | None = None) -> list[dict[str, Any]]:
        """Train to `num_steps` (or until `max_seconds` of wall clock pass), logging to
        `metrics.jsonl` and saving resumable state; returns the rows written.

        A log row holds the mean loss over its window, the lr of its last step and
        `tokens_per_s` (non-padding tokens trained per second of training over the window).
        """
        cfg = self.cfg
        self.load_state()
        log = open(self.log_path, "a")
        rows: list[dict[str, Any]] = []
        losses: list[float] = []
        tokens, seconds, t_start = 0.0, 0.0, time.perf_counter()
        try:
            while self.step < cfg.num_steps:
                t0 = time.perf_counter()
                m = self.train_step()
                seconds += time.perf_counter() - t0
                losses.append(m["loss"])
                tokens += m["tokens"]
                row: dict[str, Any] | None = None
                if self.step % cfg.log_every == 0:
                    row = {
                        "step": self.step,
                        "loss": sum(losses) / len(losses),
                        "lr": m["lr"],
                        "tokens_per_s": tokens / seconds,
                    }
                    losses, tokens, seconds = [], 0.0, 0.0
                if self.evaluator is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                    row = (row or {"step": self.step}) | self._eval()
                if row is not None:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    rows.append(row)
                if self.step % cfg.checkpoint_every == 0:
                    self.save_state()
                if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                    break
            self.save_state()
            if self.evaluator is not None and self.step >= cfg.num_steps:
                row = {"step": self.step, "final": True} | self._eval()
                log.write(json.dumps(row) + "\n")
                rows.append(row)
        finally:
            log.close()
        return rows

    def export(self, path: str, dtype: torch.dtype = torch.float16) -> None:
        """Write model (weights in `dtype`) and tokenizer to `path`, a directory that
        `CausalLMConfig(pretrained_path=path)` loads; the in-memory model keeps its dtype."""
        trained = next(self.model.parameters()).dtype
        self.model.to(dtype)
        try:
            self.bundle.save_pretrained(path)
        finally:
            self.model.to(trained)
