"""The diffusion recipes keep producing the metrics they produced before the trainer became generic.

`data/tiny_flowgrpo_rows.json` holds the rows (times and process memory left out) of a shrunken
tiny Flow-GRPO run, written by the diffusion-only trainer of commit bfe83b8 (before the driver loop
served text). The same run today must give the same rows: rewards, losses, ratios, gradient norms,
bytes moved. Floats are compared to 1e-6 relative (same arithmetic; the tolerance only absorbs a
different CPU's kernels), integers and keys exactly.
"""

from __future__ import annotations

import json
import os

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES, untimed
from unirl.config.validate import validate_rl_config
from unirl.trainer.trainer import Trainer

PINNED = os.path.join(os.path.dirname(__file__), "data", "tiny_flowgrpo_rows.json")
RECIPE = [
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "sampling.height=16",
    "sampling.width=16",
    "sampling.max_sequence_length=8",
    "model.tiny.resolution=16",
    "model.tiny.num_layers=2",
    "model.tiny.clip_max_length=8",
    "train.stack.micro_batch_size=2",
    "logging.progress=false",
    "logging.save_images_every=0",
    "num_steps=3",
    "launcher=in_process",
    "transport=inband",
    "num_devices=1",
    "threads_per_worker=1",
]


def test_tiny_flowgrpo_rows_are_unchanged(tmp_path):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose("diffusion/tiny_sd3_flowgrpo", overrides=[*RECIPE, f"output_dir={tmp_path}"])
    validate_rl_config(cfg, expect="diffusion")
    rows = [untimed(r) for r in Trainer(cfg).run()]
    with open(PINNED) as f:
        pinned = json.load(f)
    assert len(rows) == len(pinned) == 3
    for got, want in zip(rows, pinned, strict=True):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (got["step"], key)
            else:
                assert got[key] == value, (got["step"], key)
