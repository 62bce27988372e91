"""Entry point: `python -m unirl.train_diffusion --config-name=diffusion/<recipe> [key=value ...]`.

Composes the recipe with Hydra, validates it (before any Ray work), then runs
the trainer (`unirl.entry.run_recipe`). Text recipes run through
`unirl.train_vlm`, the same trainer. `--cfg job --resolve` prints the composed
recipe and exits without validating or starting Ray.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from unirl.entry import run_recipe


@hydra.main(config_path="../examples", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    run_recipe(cfg, expect="diffusion")


if __name__ == "__main__":
    main()
