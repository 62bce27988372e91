"""The tiny HunyuanVideo 1.5 Flow-GRPO recipe in this process: two steps at a test's size (4
denoising steps, 2 of them SDE), on-policy first ratio 1, a LoRA that the pipeline's transformer
loads (`load_lora_adapter`: the pipeline has no LoRA loader in diffusers 0.42) and that changes its
video; the real-size recipe validates against a saved directory."""

from __future__ import annotations

import math

import torch
from diffusers import HunyuanVideo15Pipeline

from tests.recipes import IN_PROCESS, QUIET, composed, run
from unirl.config.validate import validate_recipe
from unirl.models.flow.loading import LORA_WEIGHTS
from unirl.models.hunyuanvideo import HunyuanVideo15ModelConfig

SMALL = [
    "num_steps=2", "threads_per_worker=1", "prompts_per_rollout=2", "sampling.samples_per_prompt=2",
    "sampling.num_steps=4", "sampling.sde_num_steps=2", "train.stack.micro_batch_size=4", *QUIET,
]  # fmt: skip


def test_tiny_hunyuanvideo15_flowgrpo_trains_and_its_lora_loads(tmp_path) -> None:
    rows = run("diffusion/tiny_hunyuanvideo15_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    pipe = HunyuanVideo15Pipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)

    def video():
        return pipe(
            prompt="a red circle", height=16, width=16, num_frames=5, num_inference_steps=2, output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).frames  # fmt: skip

    before = video()
    pipe.transformer.load_lora_adapter(tmp_path / "checkpoints" / "final", weight_name=LORA_WEIGHTS)
    assert (video() - before).abs().max().item() > 0


def test_real_size_recipe_validates_against_a_directory(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "hv"
    HunyuanVideo15ModelConfig(num_frames=5).build().save_pretrained(str(directory))
    monkeypatch.setenv("PRETRAINED_MODEL", str(directory))
    validate_recipe(composed("diffusion/hunyuanvideo15_flowgrpo", tmp_path / "out"), expect="diffusion")


def test_tiny_i2v_recipe_trains_two_steps_from_first_frames(tmp_path) -> None:
    """`diffusion/tiny_hunyuanvideo15_i2v_flowgrpo`: every row's first frame conditions its
    videos through rollout and replay (on-policy first ratio 1)."""
    rows = run("diffusion/tiny_hunyuanvideo15_i2v_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
