"""Entry point: `python -m unirl.train_unified_model --config-name=unified/<recipe> [key=value ...]`.

A unified-model run: one backbone (Janus) writes a semantic plan for each prompt, then draws
image tokens after prompt + plan; one image reward is credited to both segments and each
trained segment's loss enters one joint step with its weight (BiCoT-GRPO). Validates the
recipe before any Ray work (exit 2 listing every problem), then runs
`unirl.trainer.trainer.Trainer` (exit 1 naming the step when a run stops).
`--cfg job --resolve` prints the composed recipe and exits.
"""

from __future__ import annotations

from unirl.entry import entry_point

main = entry_point("unified")

if __name__ == "__main__":
    main()
