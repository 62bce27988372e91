"""Entry point: `python -m unirl.train_pe --config-name=pe/<recipe> [key=value ...]`.

A composed run: a prompt enhancer (causal LM) rewrites user prompts, a diffusion model
renders the rewrites, the images are scored against the user's intent and the reward is
credited back to the rewrites; each track trains with its own algorithm (or stays frozen).
Validates the recipe before any Ray work (exit 2 listing every problem), then runs
`unirl.trainer.trainer.Trainer` (exit 1 naming the step when a run stops).
`--cfg job --resolve` prints the composed recipe and exits.
"""

from __future__ import annotations

from unirl.entry import entry_point

main = entry_point("composed")

if __name__ == "__main__":
    main()
