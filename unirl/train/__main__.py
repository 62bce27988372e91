"""Entry point: `python -m unirl.train --config-name=<domain>/<recipe> [key=value ...]`.

Runs any recipe: a single-track, composed or unified run, the kind read from the recipe
(`unirl.config.validate.recipe_kind`), validated before any Ray work (exit 2 listing every problem), then
trained (exit 1 naming the step when a run stops). `--cfg job --resolve` prints the composed
recipe and exits. `unirl.train_diffusion`, `train_vlm`, `train_pe` and `train_unified_model` are
the same function with the kind (and modality) they expect.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from unirl.entry import run


@hydra.main(config_path="../../examples", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
