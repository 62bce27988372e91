"""What every RL entry point does with a recipe: tell its kind, validate it, then train.

A recipe is one of three RL kinds (`unirl.config.validate.recipe_kind`): a single-track run (one model: no `tracks`),
a composed run (`tracks.<name>`, each with its own model: a prompt enhancer feeding a diffusion
model) or a unified run (`tracks.<name>` sharing the recipe's one `model`: Janus's plan and image
segments). `run` validates a recipe (`unirl.config.validate.validate_recipe`, one validator
walking every kind's tracks) before any Ray work and runs the
one `Trainer` (`unirl.trainer.trainer`), which sees every kind as a graph of tracks.
`python -m unirl.train` runs any recipe (the kind read from the recipe); the four names users
know are the same function (`entry_point`) with the kind (and a single-track run's modality)
they expect: `unirl.train_diffusion` and `unirl.train_vlm` (single-track, diffusion / text),
`unirl.train_pe` (composed) and `unirl.train_unified_model` (unified). A supervised recipe is a
single-track one whose rollout replays the data's demonstrations (`examples/*/*_sft.yaml`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import hydra
from omegaconf import DictConfig

from unirl.config.validate import ConfigError, recipe_kind, validate_recipe

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
)  # the recipes


def run(cfg: DictConfig, kind: str | None = None, modality: str | None = None) -> None:
    """Validate `cfg` as a recipe of `kind` (None: `recipe_kind(cfg)`), then run its trainer
    (`validate_then_run`)."""
    kind = kind or recipe_kind(cfg)
    validate_then_run(cfg, lambda c: validate_recipe(c, kind, expect=modality))


def entry_point(kind: str | None = None, modality: str | None = None) -> Callable[[], None]:
    """The `main` of an entry point: Hydra composes `--config-name=<domain>/<recipe>` from
    `examples/` with the command line's overrides (`--cfg job --resolve` prints the recipe and
    exits), then `run(cfg, kind, modality)`."""

    @hydra.main(config_path=EXAMPLES, config_name=None, version_base=None)
    def main(cfg: DictConfig) -> None:
        run(cfg, kind, modality)

    return main


def validate_then_run(cfg: DictConfig, validate: Callable[[DictConfig], None]) -> None:
    """`validate(cfg)` before any Ray work (exit 2 listing every problem), then
    `Trainer(cfg).run()`, imported only after validation (exit 1 with the step and last
    checkpoint when a run stops, or naming the tracker that failed)."""
    try:
        validate(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from unirl.tracking.trackers import TrackerError
    from unirl.trainer.trainer import Trainer, TrainingError  # after validation: no heavy imports first

    try:
        Trainer(cfg).run()
    except (TrainingError, TrackerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
