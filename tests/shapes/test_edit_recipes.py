"""The editing world's recipes, in one process: the base's supervised pretraining
(`diffusion/shapes_edit_sft`, a tiny FLUX.1-Kontext learning source + instruction -> target) and
Flow-GRPO and DiffusionNFT from the committed base on a fixed pool of train rows
(`diffusion/shapes_edit_flowgrpo`, `diffusion/shapes_edit_nft`), each 2 steps; the run's
evaluation hands the edit scorer its rows' sources."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.recipes import IN_PROCESS, QUIET, run
from unirl.models.flux import FluxKontextModelConfig, FluxStage
from unirl.trainer.evaluation import EvalSampling, sample_eval_images, score_images
from unirl.types import DiffusionSamplingParams
from worlds.shapes.edit import ShapesEditDataset, ShapesEditScore

BASE = "checkpoints/shapes_edit"
SMALL = [  # the pretraining recipe at a test's size: 24 px rows (the world's smallest), a 1 + 1 layer model
    "data_source.size=24",
    "data_source.placements=1",
    "eval.examples.size=24",
    "sampling.height=24",
    "sampling.width=24",
    "model.tiny.resolution=24",
    "model.tiny.num_layers=1",
    "model.tiny.num_single_layers=1",
    "eval.sampling.num_steps=2",
]

RL_STEPS = [  # an RL recipe of this world at a test's size: 2 steps of 2 rows x 4 samples, 4 denoising steps
    *IN_PROCESS,
    *QUIET,
    "threads_per_worker=1",
    "num_steps=2",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "train.stack.micro_batch_size=4",
]


def assert_sampled_from_the_pool(samples_json) -> None:
    """A step's saved samples are all prompts of the recipes' pool (32 of the train split's 630 rows)."""
    pool = {ex.prompt for ex in ShapesEditDataset("train", 0, rows=32).examples}
    sampled = json.loads(samples_json.read_text())
    assert sampled and {s["prompt"] for s in sampled} <= pool


def test_the_edit_base_pretrains_on_its_demonstrations_and_evaluates_held_out_edits(tmp_path) -> None:
    rows = run(
        "diffusion/shapes_edit_sft",
        tmp_path,
        *IN_PROCESS,
        *QUIET,
        *SMALL,
        "threads_per_worker=1",
        "num_steps=2",
        "eval.every_n_steps=2",
        "checkpoint.every_n_steps=0",
    )
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    evals = [r for r in rows if "eval/accuracy_strict" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:  # every kind of held-out edit is scored against its own source
        assert {"eval/strict/colour", "eval/strict/shape", "eval/strict/move", "eval/kept"} <= r.keys()
        assert 0.0 <= r["eval/dense"] <= 1.0
    base = FluxKontextModelConfig(pretrained_path=str(tmp_path / "checkpoints" / "final")).load_checkpoint(
        str(tmp_path / "checkpoints" / "final")
    )
    assert type(base).__name__ == "FluxKontextBundle"


def test_flow_grpo_trains_the_committed_edit_base_on_its_pool_of_rows(tmp_path) -> None:
    """The Flow-GRPO recipe trains on the same fixed pool of 32 train rows as the NFT recipe (the
    last step's samples are prompts of the pool), with SDE rollouts whose first update is on-policy."""
    rows = run(
        "diffusion/shapes_edit_flowgrpo",
        tmp_path,
        *RL_STEPS,
        "eval.every_n_steps=0",
        "checkpoint.every_n_steps=0",
        "logging.save_images_every=2",
    )
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["loss"])
    assert rows[0]["ratio/first_update_mean"] == 1.0
    assert_sampled_from_the_pool(tmp_path / "samples" / "step_0002.json")


def test_diffusion_nft_trains_the_committed_edit_base_on_its_pool_of_rows(tmp_path) -> None:
    """The NFT recipe trains on a fixed pool of 32 train rows with ODE rollouts and evaluates the
    pool itself: the last step's samples are prompts of the pool (32 of the split's 2520 rows)."""
    rows = run(
        "diffusion/shapes_edit_nft",
        tmp_path,
        *RL_STEPS,
        "eval.every_n_steps=2",
        "eval.sampling.num_steps=2",
        "eval.sampling.samples_per_prompt=1",
        "checkpoint.every_n_steps=0",
        "logging.save_images_every=2",
    )
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert 0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["loss"])
    assert train[0]["nft/v_drift_mse"] == 0.0  # the first update starts from the weights that sampled
    evals = [r for r in rows if "eval/accuracy_strict" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert_sampled_from_the_pool(tmp_path / "samples" / "step_0002.json")


def test_the_evaluation_scores_each_image_against_its_own_rows_source() -> None:
    """`score_images` hands a scorer that reads metadata each sample's row: the committed base's
    held-out edits, scored through the evaluation's request, equal the scorer applied row by row."""
    bundle = FluxKontextModelConfig(pretrained_path=BASE, tiny=None).build()
    examples = ShapesEditDataset("eval", 0, shuffle=False).examples[::21]  # 6 rows, every kind
    sp = DiffusionSamplingParams(
        height=32, width=32, guidance_scale=1.0, max_sequence_length=10, sigma_grid="steps"
    )
    ev = EvalSampling(num_steps=4, guidance_scale=1.0, samples_per_prompt=2, seed=7)
    images, req = sample_eval_images(FluxStage(bundle), examples, sp, ev)
    scorer = ShapesEditScore("strict")
    metrics = score_images(scorer, images, req)
    by_row = [
        scorer.score_all(images[i : i + 1], [ex.prompt], [ex.metadata])[0]
        for i, ex in enumerate(e for e in examples for _ in range(2))
    ]
    assert metrics["dense"] == pytest.approx(np.mean([r["dense"] for r in by_row]))
    assert metrics["strict"] == pytest.approx(np.mean([r["strict"] for r in by_row]))
    assert torch.is_tensor(images) and images.shape == (12, 3, 32, 32)
