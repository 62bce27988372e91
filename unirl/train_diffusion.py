"""Entry point: `python -m unirl.train_diffusion --config-name=diffusion/<recipe> [key=value ...]`.

Composes the recipe with Hydra, validates it (before any Ray work), then runs
the diffusion trainer. `--cfg job --resolve` prints the composed recipe and
exits without validating or starting Ray.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from unirl.config.validate import ConfigError, validate_diffusion_config


@hydra.main(config_path="../examples", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        validate_diffusion_config(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from unirl.trainer.diffusion import DiffusionTrainer, TrainingError

    try:
        DiffusionTrainer(cfg).run()
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
