"""The tiny Qwen-Image Flow-GRPO recipe through the entry point's trainer, in this process: two
steps at a test's size (16 px, 4 denoising steps, 2 of them SDE, true CFG 4.0), on-policy first
ratio 1, a LoRA exported in the file QwenImagePipeline loads."""

from __future__ import annotations

import math

from tests.recipes import IN_PROCESS, QUIET, exported_weights, run

SMALL = [
    "num_steps=2",
    "threads_per_worker=1",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "sampling.height=16",
    "sampling.width=16",
    "sampling.max_sequence_length=8",
    "model.tiny.resolution=16",
    "train.stack.micro_batch_size=4",
    *QUIET,
]


def test_tiny_qwenimage_flowgrpo_runs_two_steps(tmp_path) -> None:
    rows = run("diffusion/tiny_qwenimage_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    weights = exported_weights(tmp_path)
    assert weights and all(k.startswith("pytorch_lora_weights.safetensors:transformer.") for k in weights)
