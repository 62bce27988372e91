"""What every RL entry point does with a composed recipe: validate, then train.

`unirl.train_diffusion` and `unirl.train_vlm` differ only in the modality they
expect; both call `run_recipe` from their Hydra main.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from unirl.config.validate import ConfigError, validate_rl_config


def run_recipe(cfg: DictConfig, expect: str) -> None:
    """Validate `cfg` as a recipe of modality `expect` before any Ray work (exit 2 listing
    every problem), then run the trainer (exit 1 with the step and last checkpoint when a
    run stops)."""
    try:
        validate_rl_config(cfg, expect=expect)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from unirl.trainer.trainer import Trainer, TrainingError  # after validation: no heavy imports first

    try:
        Trainer(cfg).run()
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
