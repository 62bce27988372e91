"""Decoupled resolution: the evaluation size (`eval.sampling.height/width`) is asked of the model
family's own geometry rule before Ray, naming the eval keys and the valid values; a null side is
the rollouts' (already checked under `sampling.*`)."""

from __future__ import annotations

import json

from unirl.config.geometry import check_eval_size
from unirl.models.flux import FluxModelConfig
from unirl.models.sd3 import SD3ModelConfig
from unirl.trainer.evaluation import EvalSampling
from unirl.types import DiffusionSamplingParams


def problems(model, sampling, ev) -> list[str]:
    found: list[str] = []
    check_eval_size(model, sampling, ev, found)
    return found


def test_flux_evaluation_size_needs_multiples_of_16(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    flux = FluxModelConfig(pretrained_path=str(tmp_path), tiny=None)
    train = DiffusionSamplingParams(height=256, width=256)
    assert problems(flux, train, EvalSampling(height=512, width=768)) == []
    assert problems(flux, train, EvalSampling(height=520)) == [
        "eval.sampling.height=520 must be a multiple of 16 (FLUX packs 2x2 latent cells of 8 px), e.g. 512 or 528"
    ]
    assert problems(flux, train, EvalSampling()) == []  # null: the rollouts' size


def test_sd3_tiny_evaluation_size_fits_its_grid_and_embedding():
    sd3 = SD3ModelConfig(tiny={"resolution": 32, "pixel_space": True, "patch_size": 4})
    train = DiffusionSamplingParams(height=16, width=16)
    assert problems(sd3, train, EvalSampling(height=32, width=32)) == []
    assert problems(sd3, train, EvalSampling(width=30)) == [
        "eval.sampling.width=30 must be a multiple of 4, the pixels per latent patch of the model"
    ]
    (msg,) = problems(sd3, train, EvalSampling(height=64))
    assert msg.startswith("eval.sampling.height=64 exceeds model.tiny.resolution=32")
