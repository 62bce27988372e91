"""The tiny FLUX Flow-GRPO recipe through the entry point's trainer, in this process: two steps
at a test's size (16 px, 4 denoising steps, 2 of them SDE), on-policy first ratio 1, a LoRA
exported in the file FluxPipeline loads."""

from __future__ import annotations

import math

from tests.recipes import IN_PROCESS, exported_weights, run

SMALL = ["num_steps=2", "threads_per_worker=1"]  # with the recipe's shrunk set (tests.recipes.FLUX)


def test_tiny_flux_flowgrpo_runs_two_steps(tmp_path) -> None:
    rows = run("diffusion/tiny_flux_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    weights = exported_weights(tmp_path)
    assert weights and all(k.startswith("pytorch_lora_weights.safetensors:transformer.") for k in weights)
