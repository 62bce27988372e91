"""`diffusion/tiny_qwen_edit_flowgrpo`: Qwen-Image-Edit-Plus edits with two references per row.

In one process (no Ray) the recipe trains (true CFG, both branches reading the references;
`scripts/family_algorithms.py qwen_edit` runs every algorithm), a run stopped at a checkpoint and
resumed writes the rows and weights of the run that never stopped, and its LoRA loads into
diffusers' `QwenImageEditPlusPipeline` and changes its edit. (The references' conditions cross
Ray's data plane as FLUX.1-Kontext's do, tested in `tests/models/flux/test_kontext_recipe.py`.)
Rows without references, with an unreadable one, with references that pack differently, or whose
prompt with its references' vision tokens is longer than `sampling.max_sequence_length`, are
refused before anything runs, naming the row.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from PIL import Image

from tests.conftest import untimed
from tests.recipes import IN_PROCESS, QUIET, recipe, same_weights, stopped_and_resumed
from unirl.config.validate import ConfigError
from unirl.models.qwenimage.edit import StillImageQwenVLProcessor

RECIPE = "diffusion/tiny_qwen_edit_flowgrpo"
SMALL = [
    *IN_PROCESS,
    *QUIET,
    "threads_per_worker=1",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "model.tiny.num_layers=1",
    "train.stack.micro_batch_size=4",
]


def test_the_tiny_edit_recipe_trains_resumes_and_its_lora_loads_into_the_pipeline(
    tmp_path, monkeypatch
) -> None:
    rows, resumed = stopped_and_resumed(RECIPE, tmp_path, *SMALL, stop=2, steps=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [untimed(r) for r in resumed] == [untimed(r) for r in rows]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    for r in rows:
        assert 0.0 < r["reward/mean"] < 1.0 and torch.isfinite(torch.tensor(r["loss"]))
        assert 0.0 < r["reward/preservation/mean"] < 1.0  # the scorer read picture 1 from the row
    assert rows[0]["ratio/first_update_mean"] == 1.0  # the replay saw the rollout's references

    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", 56 * 56)  # the recipe's condition_area
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 32 * 32)  # and vae_area
    base = tmp_path / "full" / "base_model"
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        base, processor=StillImageQwenVLProcessor.from_pretrained(base / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    row = json.loads(open("datasets/tiny_edit/two_picture_prompts.jsonl").readline())
    images = [Image.open(f"datasets/tiny_edit/{name}") for name in row["images"]]

    def edit():
        return pipe(
            image=images, prompt=row["prompt"], height=16, width=16, num_inference_steps=2, true_cfg_scale=1.0,
            output_type="pt", generator=torch.Generator().manual_seed(0),
        ).images  # fmt: skip

    before = edit()
    pipe.load_lora_weights(tmp_path / "full" / "checkpoints" / "final")
    assert (edit() - before).abs().max().item() > 0


def test_rows_the_model_cannot_read_are_refused_before_the_run(tmp_path) -> None:
    Image.new("RGB", (16, 16), (0, 0, 255)).save(tmp_path / "ok.png")
    Image.new("RGB", (48, 16), (0, 0, 255)).save(tmp_path / "wide.png")
    rows = [
        {"prompt": "make the blue square red", "prompt_id": "fine", "images": ["ok.png"]},
        {"prompt": "make the blue square red", "prompt_id": "bare"},
        {"prompt": "make the blue square red", "prompt_id": "lost", "images": ["ok.png", "lost.png"]},
        {"prompt": "make the blue square red", "prompt_id": "wide", "images": ["wide.png"]},
    ]
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as info:
        recipe(RECIPE, tmp_path / "out", *SMALL, f"data_source.data_path={prompts}")
    text = "\n".join(info.value.problems)
    assert "data_source: prompt 'bare' carries no reference image in metadata 'images'" in text
    assert "'lost'" in text and "images[1]" in text and "no image file" in text
    assert "different token grids" in text and "'fine'" in text and "'wide'" in text

    with pytest.raises(ConfigError) as info:  # the readable rows, a prompt too long with its references
        recipe(RECIPE, tmp_path / "out", *SMALL, "sampling.max_sequence_length=16")
    (problem,) = info.value.problems
    assert problem.startswith("data_source: prompt 'pair")
    assert "sampling.max_sequence_length=16: raise it to at least 37" in problem
