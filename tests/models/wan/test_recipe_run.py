"""The tiny Wan Flow-GRPO recipe through the entry point's trainer, in this process: two steps at
a test's size (5 frames of 8 px, 3 denoising steps, 2 of them SDE), on-policy first ratio 1, both
video rewards scored, a frame-strip sample grid, a LoRA exported in the file WanPipeline loads."""

from __future__ import annotations

import json
import math

from tests.recipes import IN_PROCESS, QUIET, exported_weights, run

SMALL = [
    "num_steps=2",
    "threads_per_worker=1",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=2",
    "sampling.num_steps=3",
    "sampling.sde_num_steps=2",
    "sampling.height=8",
    "sampling.width=8",
    "sampling.max_sequence_length=8",
    "model.num_frames=5",
    "model.tiny.resolution=8",
    "model.tiny.num_layers=1",
    "train.stack.micro_batch_size=4",
    *QUIET,
    "logging.save_images_every=2",  # after QUIET: the frame strips are checked
]


def test_tiny_wan_flowgrpo_runs_two_steps(tmp_path) -> None:
    rows = run("diffusion/tiny_wan_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    assert all(-1 <= r["reward/motion/mean"] <= 1 and 0 <= r["reward/redness/mean"] <= 1 for r in rows)
    captions = json.loads((tmp_path / "samples" / "step_0002.json").read_text())
    assert [c["frames"] for c in captions] == [5] * 4  # the videos saved as frame strips
    weights = exported_weights(tmp_path)
    assert weights and all(k.startswith("pytorch_lora_weights.safetensors:transformer.") for k in weights)


def test_tiny_wan22_two_experts_train_resume_and_export_both_loras(tmp_path) -> None:
    """`diffusion/tiny_wan22_flowgrpo`: 3 denoising steps (timesteps 1000 | 751, 9 at the 0.875
    boundary), the SDE ones steps 0 and 1 (the window's two), so both experts' LoRAs train; a run stopped at step 2 and resumed writes the
    rows and weights of the one that never stopped, and the export is one trained LoRA file per
    expert."""
    from tests.conftest import untimed
    from tests.recipes import same_weights, stopped_and_resumed

    small = [*IN_PROCESS, *SMALL[1:], "logging.save_images_every=0"]
    full, resumed = stopped_and_resumed("diffusion/tiny_wan22_flowgrpo", tmp_path, *small, stop=2, steps=3)
    assert [untimed(r) for r in resumed] == [untimed(r) for r in full]
    assert all(r["ratio/first_update_mean"] == 1.0 for r in full)
    assert same_weights(tmp_path / "full", tmp_path / "part")
    weights = exported_weights(tmp_path / "full")
    high = [k for k in weights if k.startswith("pytorch_lora_weights.safetensors:")]
    low = [k for k in weights if k.startswith("transformer_2/pytorch_lora_weights.safetensors:")]
    assert high and len(low) == len(high) and len(weights) == 2 * len(high)
    for expert in (high, low):  # peft starts every lora_B at zero: each expert's moved from it
        assert any(weights[k].abs().sum() > 0 for k in expert if "lora_B" in k)
