"""The shapes VQA recipe wiring on a random tiny Qwen2.5-VL, trained in this process through the
RL driver (`python -m unirl.train_vlm --config-name=vlm/tiny_vqa_smoke` runs the same): prompts
carry rendered scenes, the policy (vision tower included) updates, the held-out evaluation
breaks down by question type and held-out kind, and the export loads back as a VLM."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes import run
from unirl.models.qwen_vl import QwenVLConfig
from worlds.shapes.vqa import ShapesVQADataset

pytestmark = [pytest.mark.e2e]

# a dense reward a random model earns some of (the answer reward is all zeros for it), so the
# update is not empty: the fraction of the response's characters that are lower-case letters
DENSE = [
    "+reward.backend.components.digits={_target_: unirl.reward.local.text.TargetCharFraction, chars: abcdefghijklmnopqrstuvwxyz}",
    "+reward.backend.weights.digits=1.0",
]


def test_vqa_smoke_recipe_trains_the_vlm_and_evaluates(tmp_path):
    rows = run("vlm/tiny_vqa_smoke", tmp_path, *DENSE, "logging.save_images_every=1")
    assert [r["step"] for r in rows[:3]] == [0, 1, 2]
    assert rows[1]["ratio/first_update_mean"] == 1.0  # pi_old replayed with the same images
    assert all(r["reward/digits/mean"] > 0 for r in rows[1:3])
    evals = ShapesVQADataset("eval_all", size=4).examples
    groups = {f"qtype={e.metadata['qtype']}" for e in evals} | {"holdout=combination", "holdout=placement"}
    assert {
        k.removeprefix("eval/accuracy/greedy/") for k in rows[2] if k.startswith("eval/accuracy/greedy/")
    } == groups
    samples = json.loads((tmp_path / "samples" / "step_0002.json").read_text())
    assert len(samples) == 8 and all(s["prompt"].startswith("<image>") for s in samples)
    # the export loads back as a VLM whose weights moved from the seed's, the vision tower's too
    tiny = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml").model.tiny)
    start = QwenVLConfig(tiny=tiny).build().model.state_dict()
    loaded = QwenVLConfig(tiny=tiny).load_checkpoint(str(tmp_path / "checkpoints" / "final"))
    final = loaded.model.state_dict()
    assert loaded.has_vision and final.keys() == start.keys()
    moved = {k for k, v in final.items() if not torch.equal(v, start[k])}
    assert any(k.startswith("model.visual.") for k in moved) and any("language_model" in k for k in moved)
