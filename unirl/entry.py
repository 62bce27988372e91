"""What every RL entry point does with a recipe: validate, then train.

`unirl.train_diffusion` and `unirl.train_vlm` differ only in the modality they
expect; both call `run_recipe` from their Hydra main. `unirl.train_pe` calls
`validate_then_run` with the composed validator and trainer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig

from unirl.config.validate import ConfigError, validate_rl_config


def run_recipe(cfg: DictConfig, expect: str) -> None:
    """Validate `cfg` as a recipe of modality `expect`, then run `Trainer` (see `validate_then_run`)."""
    validate_then_run(cfg, lambda c: validate_rl_config(c, expect=expect), "unirl.trainer.trainer.Trainer")


def validate_then_run(cfg: DictConfig, validate: Callable[[DictConfig], None], trainer: str) -> None:
    """`validate(cfg)` before any Ray work (exit 2 listing every problem), then
    `<trainer>(cfg).run()`, the trainer named by its class path and imported only after
    validation (exit 1 with the step and last checkpoint when a run stops, or naming the
    tracker that failed)."""
    try:
        validate(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from hydra.utils import get_class

    from unirl.tracking.trackers import TrackerError
    from unirl.trainer.trainer import TrainingError  # after validation: no heavy imports first

    try:
        get_class(trainer)(cfg).run()
    except (TrainingError, TrackerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
