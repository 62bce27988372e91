"""Supervised flow-matching training of a text-to-image bundle (pretraining / the SFT stage).

Loss (rectified flow, as SD3): for clean images x0 in [-1, 1], noise eps and
noise level sigma, x_sigma = (1 - sigma) x0 + sigma eps and the denoiser is
regressed onto the velocity v = eps - x0:  L = mean ||v_theta(x_sigma, sigma, c) - v||^2.
sigma is drawn logit-normal (SD3's default) or uniform, then shifted like the
sampling schedule. With probability `cond_dropout` the prompt is replaced by
"" so classifier-free guidance works at sampling time. The transformer and
(optionally) the text encoders are trained; the run is resumable from its
`sft_state.pt`.
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

from unirl.models.sd3.bundle import SD3Bundle
from unirl.train.backend import LR_SCHEDULES, lr_factor

SIGMA_SAMPLING = ("logit_normal", "uniform")


@dataclass
class FlowMatchingSFTConfig:
    """Settings of a supervised flow-matching run.

    Attributes:
        num_steps: optimizer steps in total (a resumed run continues to it).
        batch_size: images per step.
        lr, weight_decay, warmup_steps, lr_schedule, max_grad_norm: AdamW and its schedule.
        sigma_sampling: "logit_normal" (sigmoid of N(0, 1)) or "uniform".
        shift: sigma = shift*t / (1 + (shift-1)*t), matching the sampling schedule.
        cond_dropout: probability of training on the empty prompt.
        train_text_encoders: also train the text encoders (a tiny model's are random).
        max_sequence_length: T5 token budget.
        checkpoint_every: steps between resumable state saves.
        eval_every: steps between evaluations (0 disables).
        log_every: steps between log rows.
        seed: data and noise seed.
    """

    num_steps: int = 10000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 200
    lr_schedule: str = "cosine"
    max_grad_norm: float = 1.0
    sigma_sampling: str = "logit_normal"
    shift: float = 1.0
    cond_dropout: float = 0.1
    train_text_encoders: bool = True
    max_sequence_length: int = 16
    checkpoint_every: int = 250
    eval_every: int = 1000
    log_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sigma_sampling not in SIGMA_SAMPLING:
            raise ValueError(
                f"sft.sigma_sampling must be one of {SIGMA_SAMPLING}, got {self.sigma_sampling!r}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"sft.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"sft.cond_dropout must be in [0, 1), got {self.cond_dropout}")
        for key in ("num_steps", "batch_size", "checkpoint_every", "log_every", "max_sequence_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"sft.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("weight_decay", "warmup_steps", "eval_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"sft.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("lr", "max_grad_norm", "shift"):
            if not getattr(self, key) > 0:
                raise ValueError(f"sft.{key} must be > 0, got {getattr(self, key)}")


class ImageTextSource(Protocol):
    """Supervised data: `sample_batch(n, rng) -> (uint8 images [n, H, W, 3], prompts)`."""

    def sample_batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]: ...


def flow_matching_loss(pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the predicted velocity against eps - x0 (fp32 scalar)."""
    return ((pred.float() - (eps - x0).float()) ** 2).mean()


def sample_sigmas(n: int, cfg: FlowMatchingSFTConfig, gen: torch.Generator) -> torch.Tensor:
    """[n] fp32 training noise levels in (0, 1)."""
    if cfg.sigma_sampling == "logit_normal":
        t = torch.sigmoid(torch.randn(n, generator=gen))
    else:
        t = torch.rand(n, generator=gen).clamp(1e-4, 1 - 1e-4)
    return cfg.shift * t / (1 + (cfg.shift - 1) * t)


def images_to_model(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> fp32 [n, 3, H, W] in [-1, 1] (the pixel-space model's range)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


class FlowMatchingSFT:
    """Trains `bundle` on `data` with the flow-matching loss.

    Args:
        bundle: a pixel-space SD3 bundle (its VAE, if any, is not supported here),
            on the device to train on. Noise and timesteps are drawn on the CPU from
            the seeded generator (the same run on every device) and moved there.
        data: the supervised source.
        config: run settings.
        out_dir: where `sft_state.pt` (resumable) and `sft_log.jsonl` go.
        evaluate: optional `evaluate(bundle) -> dict[str, float]` run every
            `eval_every` steps and at the end; its numbers go into the log.
    """

    def __init__(
        self,
        bundle: SD3Bundle,
        data: ImageTextSource,
        config: FlowMatchingSFTConfig,
        out_dir: str,
        evaluate: Callable[[SD3Bundle], dict[str, float]] | None = None,
    ) -> None:
        if not bundle.pixel_space:
            raise ValueError("FlowMatchingSFT trains pixel-space bundles (model.tiny.pixel_space: true)")
        self.bundle, self.data, self.cfg, self.out, self.evaluate = bundle, data, config, out_dir, evaluate
        p = bundle.pipeline
        self.modules = [bundle.transformer]
        if config.train_text_encoders:
            self.modules += [p.text_encoder, p.text_encoder_2, p.text_encoder_3]
        for m in self.modules:
            m.requires_grad_(True).train()
        self.params = [q for m in self.modules for q in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(config.lr_schedule, s, config.num_steps, config.warmup_steps)
        )
        self.step = 0
        self.rng = np.random.default_rng(config.seed)
        self.gen = torch.Generator().manual_seed(config.seed)
        os.makedirs(out_dir, exist_ok=True)
        self.state_path = os.path.join(out_dir, "sft_state.pt")

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        images, prompts = self.data.sample_batch(cfg.batch_size, self.rng)
        drop = torch.rand(len(prompts), generator=self.gen) < cfg.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        device = self.bundle.device
        x0 = images_to_model(images).to(device)
        size = self.bundle.transformer.config.sample_size
        if tuple(x0.shape[-2:]) != (size, size):
            raise ValueError(
                f"the data gives {tuple(x0.shape[-2:])} images but the model is built for {size}x{size} "
                "(match model.tiny.resolution to the data)"
            )
        eps = torch.randn(x0.shape, generator=self.gen).to(device)
        sigma = sample_sigmas(len(prompts), cfg, self.gen).to(device)
        s = sigma.view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        pe, _, pp, _ = self.bundle.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=cfg.max_sequence_length,
        )
        pred = self.bundle.transformer(
            hidden_states=x_t,
            timestep=sigma * 1000.0,
            encoder_hidden_states=pe,
            pooled_projections=pp,
            return_dict=False,
        )[0]
        loss = flow_matching_loss(pred, x0, eps)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
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

        Rows of `sft_log.jsonl` past the saved step (logged after the last
        checkpoint by a run that was then stopped), and a final-eval row, are
        dropped: the resumed run logs them again.
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
        log_path = os.path.join(self.out, "sft_log.jsonl")
        if os.path.exists(log_path):
            with open(log_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            keep = [r for r in rows if r["step"] <= self.step and not r.get("final")]
            if len(keep) != len(rows):
                with open(log_path + ".tmp", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in keep)
                os.replace(log_path + ".tmp", log_path)
        return True

    def _eval(self) -> dict[str, float]:
        for m in self.modules:
            m.eval()
        try:
            return {f"eval/{k}": v for k, v in self.evaluate(self.bundle).items()}
        finally:
            for m in self.modules:
                m.train()

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, max_seconds: float | None = None) -> list[dict[str, Any]]:
        """Train to `num_steps` (or until `max_seconds` of wall clock pass), logging to
        `sft_log.jsonl` and saving resumable state; returns the rows written."""
        cfg = self.cfg
        self.load_state()
        log = open(os.path.join(self.out, "sft_log.jsonl"), "a")
        rows, window, t_start = [], [], time.perf_counter()
        try:
            while self.step < cfg.num_steps:
                t0 = time.perf_counter()
                m = self.train_step()
                window.append(m["loss"])
                row: dict[str, Any] | None = None
                if self.step % cfg.log_every == 0:
                    row = {
                        "step": self.step,
                        "loss": sum(window) / len(window),
                        "lr": m["lr"],
                        "step_s": time.perf_counter() - t0,
                    }
                    window = []
                if self.evaluate is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
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
            if self.evaluate is not None and self.step >= cfg.num_steps:
                row = {"step": self.step, "final": True} | self._eval()
                log.write(json.dumps(row) + "\n")
                rows.append(row)
        finally:
            log.close()
        return rows

    def export(self, path: str, dtype: torch.dtype = torch.float16) -> None:
        """Save the whole bundle (diffusers layout) with weights in `dtype`; the
        in-memory model keeps its fp32 weights."""
        pipe = self.bundle.pipeline
        pipe.to(dtype)
        try:
            pipe.save_pretrained(path)
        finally:
            pipe.to(torch.float32)
