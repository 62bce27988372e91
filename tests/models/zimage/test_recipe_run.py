"""The tiny Z-Image Flow-GRPO recipe in this process: two steps at a test's size (4 denoising
steps, 2 of them SDE, CFG 2.0), on-policy first ratio 1, a LoRA that `ZImagePipeline` loads and
that changes its image."""

from __future__ import annotations

import math

import torch
from diffusers import ZImagePipeline

from tests.recipes import IN_PROCESS, QUIET, run

SMALL = [
    "num_steps=2", "threads_per_worker=1", "prompts_per_rollout=2", "sampling.samples_per_prompt=4",
    "sampling.num_steps=4", "sampling.sde_num_steps=2", "sampling.max_sequence_length=16",
    "model.tiny.num_layers=1", "train.stack.micro_batch_size=4", *QUIET,
]  # fmt: skip


def test_tiny_zimage_flowgrpo_trains_and_its_lora_loads_into_the_pipeline(tmp_path) -> None:
    rows = run("diffusion/tiny_zimage_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    pipe = ZImagePipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)

    def image():
        return pipe(
            prompt="a red circle", height=16, width=16, num_inference_steps=2, guidance_scale=1.0,
            max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0),
        ).images  # fmt: skip

    before = image()
    pipe.load_lora_weights(tmp_path / "checkpoints" / "final")
    assert (image() - before).abs().max().item() > 0
