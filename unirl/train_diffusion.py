"""Entry point: `python -m unirl.train_diffusion --config-name=diffusion/<recipe> [key=value ...]`.

Composes the recipe with Hydra, validates it (before any Ray work), then runs
the trainer (`unirl.entry.entry_point`). Text recipes run through
`unirl.train_vlm`, the same trainer. `--cfg job --resolve` prints the composed
recipe and exits without validating or starting Ray.
"""

from __future__ import annotations

from unirl.entry import entry_point

main = entry_point("single", "diffusion")

if __name__ == "__main__":
    main()
