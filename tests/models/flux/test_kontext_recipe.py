"""`diffusion/tiny_kontext_flowgrpo`: FLUX.1-Kontext edits the source images of its prompt rows.

In one process (no Ray): the recipe trains 2 steps with Flow-GRPO and with DiffusionNFT (the
reference image rides with every rollout and replay; `scripts/family_algorithms.py` runs every
algorithm), its LoRA loads into
diffusers' `FluxKontextPipeline` and changes its output, and a prompt file whose rows carry no
source, two sources or a missing file is refused before anything runs, naming the row.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from tests.conftest import untimed
from tests.recipes import IN_PROCESS, QUIET, recipe, run, same_weights
from unirl.config.validate import ConfigError

RECIPE = "diffusion/tiny_kontext_flowgrpo"
SMALL = [
    *IN_PROCESS,
    *QUIET,
    "threads_per_worker=1",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "sampling.max_sequence_length=8",
    "model.tiny.num_layers=1",
    "model.tiny.num_single_layers=1",
    "model.tiny.clip_max_length=8",
    "train.stack.micro_batch_size=4",
]
NFT = [
    "algorithm._target_=unirl.algorithms.diffusion_nft.DiffusionNFT",
    "algorithm.config._target_=unirl.algorithms.diffusion_nft.DiffusionNFTConfig",
    "~algorithm.config.clip_range",
    "~algorithm.config.clip_schedule",
    "~algorithm.config.beta",
    "~algorithm.config.old_logp_source",
    "sampling.eta=0.0",
    "sampling.sde_scheduler=all",
]


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_the_tiny_edit_recipe_trains(tmp_path, algorithm) -> None:
    extra = NFT if algorithm == "diffusion_nft" else []
    rows = run(RECIPE, tmp_path, *SMALL, "num_steps=2", *extra)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 < r["reward/mean"] < 1.0 and torch.isfinite(torch.tensor(r["loss"]))
    if algorithm == "flow_grpo":
        assert rows[0]["ratio/first_update_mean"] == 1.0  # the replay saw the rollout's reference


def test_its_lora_loads_into_flux_kontext_pipeline(tmp_path) -> None:
    """The exported LoRA is what `FluxKontextPipeline.load_lora_weights` reads: the pipeline
    built from the run's base model (latent space: the pipeline needs a VAE to encode its image)
    edits a source differently once it is loaded."""
    run(RECIPE, tmp_path, *SMALL, "num_steps=2", "model.tiny.pixel_space=false")
    pipe = FluxKontextPipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)
    source = Image.open("datasets/tiny_edit/blue_square.png")

    def edit():
        return pipe(
            image=source, prompt="make the blue square red", height=16, width=16, max_area=256,
            _auto_resize=False, num_inference_steps=2, max_sequence_length=8, output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).images

    before = edit()
    pipe.load_lora_weights(tmp_path / "checkpoints" / "final")
    assert (edit() - before).abs().max().item() > 0


def test_rows_without_a_usable_source_are_refused_before_the_run(tmp_path) -> None:
    source = tmp_path / "ok.png"
    Image.new("RGB", (16, 16), (0, 0, 255)).save(source)
    rows = [
        {"prompt": "make it red", "prompt_id": "fine", "images": ["ok.png"]},
        {"prompt": "make it red", "prompt_id": "bare"},
        {"prompt": "make it red", "prompt_id": "pair", "images": ["ok.png", "ok.png"]},
        {"prompt": "make it red", "prompt_id": "lost", "images": ["lost.png"]},
    ]
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as info:
        recipe(RECIPE, tmp_path / "out", *SMALL, f"data_source.data_path={prompts}")
    text = "\n".join(info.value.problems)
    assert "data_source: prompt 'bare' carries no condition image" in text
    assert "prompt 'pair' carries 2" in text and "'lost'" in text and "no image file" in text


@pytest.mark.ray
def test_a_ray_run_with_its_sources_resumes_exactly(tmp_path, ray_cluster) -> None:
    """Through Ray and the object-store data plane: the source latents ride with each track from
    the rollout to training; stopped at a step-2 checkpoint and resumed, the run writes the rows
    and the final weights of the run that never stopped."""
    ray_run = [o for o in SMALL if o not in IN_PROCESS] + ["num_steps=3", "transport=ray"]
    full = run(RECIPE, tmp_path / "full", *ray_run, "checkpoint.every_n_steps=2")
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002"
    resumed = run(RECIPE, tmp_path / "resumed", *ray_run, f"resume_from={ckpt}")
    assert [r["step"] for r in resumed] == [3]
    assert untimed(resumed[0]) == untimed(full[2])
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
