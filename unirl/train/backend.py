"""The train backend: owns the trainable module, LoRA injection, optimizer, LR schedule.

One backend per trainable module. It injects LoRA (peft, through diffusers'
adapter API) or trains all weights, builds AdamW and the LR schedule, clips
gradients, and skips the optimizer step when the gradient norm is not finite.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class LoRAConfig:
    """LoRA on the denoiser via peft. `target_modules` are module-name suffixes."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init_lora_weights: bool | str = True


@dataclass
class OptimConfig:
    """AdamW, LR schedule and gradient clipping.

    Attributes:
        lr, betas, weight_decay, eps: AdamW.
        lr_schedule: "constant", "linear" (decay to 0) or "cosine" (to 0),
            over `total_steps` optimizer steps after `warmup_steps` linear warm-up.
        max_grad_norm: clip the global grad norm; a non-finite norm skips the step.
    """

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"train.optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"
            )
        if self.lr <= 0:
            raise ValueError(f"train.optim.lr must be > 0, got {self.lr}")


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


class TrainBackend:
    """Owns the trainable module and its optimizer state.

    Args:
        module: the denoiser to train (modified in place: LoRA is injected).
        lora: LoRA config, or None for a full fine-tune.
        optim: optimizer config.
        total_steps: number of optimizer steps of the run (for LR schedules).
    """

    def __init__(
        self, module: torch.nn.Module, lora: LoRAConfig | None, optim: OptimConfig, total_steps: int
    ) -> None:
        self.module = module
        self.lora = lora
        self.optim_cfg = optim
        self._reference: torch.nn.Module | None = None
        if lora is not None:
            self._inject_lora(lora)
        else:
            module.requires_grad_(True)
        self.params = [p for p in module.parameters() if p.requires_grad]
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
        self.optimizer_steps = 0
        self.skipped_steps = 0

    def _inject_lora(self, cfg: LoRAConfig) -> None:
        from peft import LoraConfig

        names = [n for n, _ in self.module.named_modules()]
        unmatched = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            raise ValueError(
                f"train.lora.target_modules {unmatched} match no module of {type(self.module).__name__}; "
                "use module-name suffixes such as to_q, to_k, to_v, to_out.0"
            )
        self.module.requires_grad_(False)
        self.module.add_adapter(
            LoraConfig(
                r=cfg.rank,
                lora_alpha=cfg.alpha,
                lora_dropout=cfg.dropout,
                target_modules=list(cfg.target_modules),
                init_lora_weights=cfg.init_lora_weights,
            )
        )

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the module as the reference policy: LoRA disabled, or (full
        fine-tune) the weights as they were at construction."""
        if self.lora is not None:
            self.module.disable_adapters()
            try:
                yield
            finally:
                self.module.enable_adapters()
            return
        if self._reference is None:
            raise RuntimeError("a full fine-tune keeps no reference weights; call keep_reference() at setup")
        live = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(self._reference.state_dict())
        try:
            yield
        finally:
            self.module.load_state_dict(live)

    def keep_reference(self) -> None:
        """Full fine-tune only: keep a frozen copy of the current weights as the reference."""
        if self.lora is None and self._reference is None:
            self._reference = copy.deepcopy(self.module).requires_grad_(False)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, then step (or skip on a non-finite grad norm). Returns metrics."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        finite = bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        self.zero_grad()
        return {"train/grad_norm": float(norm), "train/lr": lr, "train/skipped_step": float(not finite)}

    def save_weights(self, path: str, base_model: str | None) -> None:
        """Write loadable weights: a diffusers LoRA file (`pytorch_lora_weights.safetensors`)
        or a full `transformer/` directory, plus `unirl_checkpoint.json` naming the base."""
        os.makedirs(path, exist_ok=True)
        if self.lora is not None:
            from diffusers import StableDiffusion3Pipeline
            from peft.utils import get_peft_model_state_dict

            StableDiffusion3Pipeline.save_lora_weights(
                path, transformer_lora_layers=get_peft_model_state_dict(self.module)
            )
            kind = "lora"
        else:
            self.module.save_pretrained(os.path.join(path, "transformer"))
            kind = "full"
        with open(os.path.join(path, "unirl_checkpoint.json"), "w") as f:
            json.dump(
                {"kind": kind, "base_model": base_model, "optimizer_steps": self.optimizer_steps}, f, indent=2
            )
