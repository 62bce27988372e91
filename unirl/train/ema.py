"""Exponential moving average (EMA) of trainable weights, for sampling with smoothed weights.

The EMA keeps an fp32 shadow copy of the parameters it is given and knows nothing about the
module they come from: with LoRA the owner passes only the trainable adapter parameters
(`TrainBackend.params` with their names), with a full fine-tune all of them. Parameters may be
plain tensors or DTensors (FSDP2 `fully_shard`); every shadow lives in the same placement as
its parameter and is updated with in-place ops on the local shard, so no communication happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import torch
from annotated_types import Interval
from torch.distributed.tensor import DTensor

from unirl.models.weights import reshard_all, swapped_weights
from unirl.types.constraints import NonNegative, OpenUnit, check_fields

EMA_SCHEDULES = ("constant", "warmup", "linear")
EMA_UPDATE_ON = ("optimizer_step", "rollout")


@dataclass
class EMAConfig:
    """How the EMA decays and when its owner updates it.

    Attributes:
        decay: the decay d in shadow <- d * shadow + (1 - d) * param; 0 < decay < 1.
        schedule: "constant" uses d_t = decay; "warmup" uses
            d_t = min(decay, (1 + t) / (10 + t)), where t is the number of EMA updates applied
            before this one (0 for the first), so early updates follow the weights closely;
            "linear" uses d_t = min(decay, decay_start + decay_slope (t - warmup_steps)) (CRD's
            and DGPO's snapshots: a snapshot that tracks the weights closely at first and
            trails them more and more).
        warmup_steps: the first `warmup_steps` updates use d_t = 0 (the shadow copies the
            weights); the schedule applies from update `warmup_steps` on, with t still counting
            all updates.
        decay_start: d at the first scheduled update of "linear", in [0, 1).
        decay_slope: the growth of d per update of "linear", >= 0.
        update_on: when the owner calls `EMA.update()`: "optimizer_step" after each optimizer
            step that was taken (not after a skipped one), "rollout" once per rollout batch. The
            EMA does not check this; it only counts `update()` calls.
    """

    decay: OpenUnit = 0.999
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_start: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    decay_slope: NonNegative = 0.0
    update_on: str = "optimizer_step"

    def __post_init__(self) -> None:
        check_fields(self, "train.ema.")
        if self.schedule not in EMA_SCHEDULES:
            raise ValueError(f"train.ema.schedule must be one of {EMA_SCHEDULES}, got {self.schedule!r}")
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(f"train.ema.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.update_on not in EMA_UPDATE_ON:
            raise ValueError(f"train.ema.update_on must be one of {EMA_UPDATE_ON}, got {self.update_on!r}")


class EMA:
    """An fp32 shadow of named parameters, updated as shadow <- d * shadow + (1 - d) * param.

    Args:
        named_params: (name, parameter) pairs to track; names must be unique. With LoRA pass the
            trainable adapter parameters only, with a full fine-tune all of them; parameters
            may be plain tensors or DTensors. The EMA holds references to these parameter
            objects, so they must stay the module's parameters (build it after `fully_shard`).
        config: decay schedule; see `EMAConfig`.

    The shadow starts as a copy of the parameters' current values. `update()` is called by the
    owner at the cadence `config.update_on` names.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], config: EMAConfig) -> None:
        if not named_params:
            raise ValueError("EMA got no parameters to track (pass the trainable named parameters)")
        names = [name for name, _ in named_params]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"EMA parameter names must be unique, got duplicates {duplicates}")
        self.config = config
        self._params = dict(named_params)
        self._shadow = {name: p.detach().to(torch.float32, copy=True) for name, p in self._params.items()}
        self._num_updates = 0
        self._swapped = False

    @property
    def num_updates(self) -> int:
        """Number of `update()` calls applied so far (the t of the next update)."""
        return self._num_updates

    def decay_at(self, t: int) -> float:
        """The decay d_t of update number `t` (0-based), per `EMAConfig`."""
        if t < 0:
            raise ValueError(f"EMA update index must be >= 0, got {t}")
        if t < self.config.warmup_steps:
            return 0.0
        if self.config.schedule == "constant":
            return self.config.decay
        if self.config.schedule == "linear":
            cfg = self.config
            return min(cfg.decay, cfg.decay_start + cfg.decay_slope * (t - cfg.warmup_steps))
        return min(self.config.decay, (1 + t) / (10 + t))

    @torch.no_grad()
    def update(self) -> float:
        """Move every shadow towards its parameter: shadow <- d * shadow + (1 - d) * param.

        Uses d = `decay_at(num_updates)`, then increments `num_updates`. Returns the d used.
        """
        self._check_not_swapped("update()")
        d = self.decay_at(self._num_updates)
        for name, p in self._params.items():
            self._shadow[name].lerp_(p.detach().to(torch.float32), 1.0 - d)
        self._num_updates += 1
        return d

    @contextlib.contextmanager
    def swap(self, fsdp_module: torch.nn.Module | None = None) -> Iterator[None]:
        """Run the body with the shadow weights in the live parameters.

        On entry the live values are saved and the shadow is copied in (cast to each
        parameter's dtype); on exit, also when the body raises, the saved values are copied
        back bit-exactly. `update()`, `copy_to_params()` and a nested `swap()` inside the body
        raise RuntimeError.

        Args:
            fsdp_module: with FSDP2, the root module given to `fully_shard`. Every FSDP module in
                it is resharded on entry and exit, so no forward reuses weights all-gathered
                before the swap, or shadow weights after it. Required for FSDP2 whenever a
                forward may have run without backward.
        """
        self._check_not_swapped("swap()")
        self._swapped = True
        names = list(self._params)
        try:
            with swapped_weights(
                [self._params[n] for n in names], [self._shadow[n] for n in names], fsdp_module
            ):
                yield
        finally:
            self._swapped = False

    @torch.no_grad()
    def copy_to_params(self, fsdp_module: torch.nn.Module | None = None) -> None:
        """Permanently copy the shadow weights into the live parameters (cast to their dtype).

        `fsdp_module`: as in `swap()`; with FSDP2 pass the root module so the next forward
        all-gathers the new weights.
        """
        self._check_not_swapped("copy_to_params()")
        reshard_all(fsdp_module)
        for name, p in self._params.items():
            p.copy_(self._shadow[name])

    def state_dict(self) -> dict:
        """{"num_updates": int, "shadow": {name: fp32 tensor}}.

        The tensors are the live shadows (not copies; clone them to keep a snapshot) and are
        DTensors where the parameters are.
        """
        return {"num_updates": self._num_updates, "shadow": dict(self._shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a `state_dict()` of an EMA over the same names, shapes and layout.

        Raises KeyError naming missing or unexpected parameter names and ValueError on a shape
        or DTensor/plain-tensor mismatch; nothing is modified unless every check passes.
        """
        self._check_not_swapped("load_state_dict()")
        for key in ("num_updates", "shadow"):
            if key not in state:
                raise KeyError(f"EMA state_dict lacks {key!r} (expected keys 'num_updates' and 'shadow')")
        shadow = state["shadow"]
        missing = [n for n in self._shadow if n not in shadow]
        unexpected = [n for n in shadow if n not in self._shadow]
        if missing or unexpected:
            raise KeyError(f"EMA state_dict names do not match: missing {missing}, unexpected {unexpected}")
        for name, dst in self._shadow.items():
            src = shadow[name]
            if src.shape != dst.shape:
                raise ValueError(
                    f"EMA state_dict shadow {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            if isinstance(src, DTensor) != isinstance(dst, DTensor):
                raise ValueError(
                    f"EMA state_dict shadow {name!r} is a {type(src).__name__} but the parameter is a "
                    f"{type(dst).__name__}; load the state into an EMA built on the same layout"
                )
        num_updates = state["num_updates"]
        if not isinstance(num_updates, int) or num_updates < 0:
            raise ValueError(f"EMA state_dict num_updates must be an int >= 0, got {num_updates!r}")
        for name, dst in self._shadow.items():
            dst.copy_(shadow[name])
        self._num_updates = num_updates

    def _check_not_swapped(self, what: str) -> None:
        if self._swapped:
            raise RuntimeError(f"EMA.{what} called inside EMA.swap(); call it after the swap block")
