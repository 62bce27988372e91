"""The tiny FLUX.2-dev and FLUX.2-Klein Flow-GRPO recipes in this process: two steps at a test's
size (4 denoising steps, 2 of them SDE), on-policy first ratio 1, a LoRA that the family's
pipeline loads and that changes its image; the real-size recipes validate against a directory of
their pipeline and refuse the other's, and a step-distilled Klein refuses a guidance scale."""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from tests.recipes import IN_PROCESS, QUIET, composed, run
from unirl.config.validate import ConfigError, validate_recipe
from unirl.models.flux2 import Flux2KleinModelConfig, Flux2ModelConfig

SMALL = [
    "num_steps=2", "threads_per_worker=1", "prompts_per_rollout=2", "sampling.samples_per_prompt=4",
    "sampling.num_steps=4", "sampling.sde_num_steps=2", "train.stack.micro_batch_size=4", *QUIET,
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "pipeline", "length"),
    [
        ("tiny_flux2_flowgrpo", Flux2Pipeline, 48),
        ("tiny_flux2_klein_flowgrpo", Flux2KleinPipeline, 32),
        ("tiny_flux2_edit_flowgrpo", Flux2Pipeline, 48),  # two reference images per row
    ],
)
def test_tiny_flux2_flowgrpo_trains_and_its_lora_loads_into_the_pipeline(
    tmp_path, name, pipeline, length
) -> None:
    rows = run(f"diffusion/{name}", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    pipe = pipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)
    layers = (10, 20, 30) if pipeline is Flux2Pipeline else (9, 18, 27)

    def image():
        return pipe(
            prompt="a red circle", height=16, width=16, num_inference_steps=2, guidance_scale=4.0,
            max_sequence_length=length, text_encoder_out_layers=layers, output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).images  # fmt: skip

    before = image()
    pipe.load_lora_weights(tmp_path / "checkpoints" / "final")
    assert (image() - before).abs().max().item() > 0


def test_real_size_recipes_validate_against_their_directory(tmp_path, monkeypatch) -> None:
    klein, dev = tmp_path / "klein", tmp_path / "dev"
    Flux2KleinModelConfig().build().save_pretrained(str(klein))
    Flux2ModelConfig().build().save_pretrained(str(dev))

    def problems(name: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_recipe(composed(f"diffusion/{name}", tmp_path / "out"), expect="diffusion")
        return str(info.value)

    monkeypatch.setenv("PRETRAINED_MODEL", str(klein))
    validate_recipe(composed("diffusion/flux2_klein_flowgrpo", tmp_path / "out"), expect="diffusion")
    assert "names 'Flux2KleinPipeline', not Flux2Pipeline" in problems("flux2_flowgrpo")
    index = klein / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "is_distilled": True}))
    assert "sampling.guidance_scale=4.0: this FLUX.2-Klein is step-distilled" in problems(
        "flux2_klein_flowgrpo"
    )
    monkeypatch.setenv("PRETRAINED_MODEL", str(dev))
    validate_recipe(composed("diffusion/flux2_flowgrpo", tmp_path / "out"), expect="diffusion")
    assert "names 'Flux2Pipeline', not Flux2KleinPipeline" in problems("flux2_klein_flowgrpo")
