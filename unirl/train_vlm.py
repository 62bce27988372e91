"""Entry point: `python -m unirl.train_vlm --config-name=llm/<recipe> [key=value ...]`.

Composes the recipe with Hydra, validates it (before any Ray work), then runs
the trainer: the same driver loop as `unirl.train_diffusion`, over a causal-LM
(or, later, vision-language) family and a text algorithm. Text-only LMs run
through it too. `--cfg job --resolve` prints the composed recipe and
exits without validating or starting Ray.
"""

from __future__ import annotations

from unirl.entry import entry_point

main = entry_point("single", "text")

if __name__ == "__main__":
    main()
