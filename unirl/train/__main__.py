"""Entry point: `python -m unirl.train --config-name=<domain>/<recipe> [key=value ...]`.

Runs any recipe: a single-track, composed or unified run, the kind read from the recipe
(`unirl.config.validate.recipe_kind`), validated before any Ray work (exit 2 listing every problem), then
trained (exit 1 naming the step when a run stops). `--cfg job --resolve` prints the composed
recipe and exits. `unirl.train_diffusion`, `train_vlm`, `train_pe` and `train_unified_model` are
the same function with the kind (and modality) they expect.
"""

from __future__ import annotations

from unirl.entry import entry_point

main = entry_point()

if __name__ == "__main__":
    main()
