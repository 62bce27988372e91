"""The dedicated-engine recipes through their entry points, a few steps each on shrunken sizes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_module
from tests.trainer.test_distributed_runs import SMALL

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

LM_SMALL = ["prompts_per_rollout=4", "sampling.samples_per_prompt=4", "logging.progress=false"]
CASES = {
    "diffusion/tiny_sd3_dedicated_colocate": ("unirl.train_diffusion", SMALL, [0, 0]),
    "diffusion/tiny_sd3_dedicated_separate": ("unirl.train_diffusion", SMALL, [0, 1]),
    "llm/tiny_lm_dedicated": ("unirl.train_vlm", LM_SMALL, [0, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_runs_through_its_entry_point(name, tmp_path):
    module, small, staleness = CASES[name]
    res = run_module(
        module,
        f"--config-name={name}",
        *small,
        f"num_steps={len(staleness)}",
        "rollout.forward_batch_size=2",
        f"output_dir={tmp_path}",
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness"] for r in rows] == staleness
    assert all(r["sync/bytes"] > 0 for r in rows[: len(staleness) - 1])  # a sync before each later rollout
    placed = json.loads((tmp_path / "placement.json").read_text())
    assert [e["engine"] for e in placed["engines"]] == [0]
    assert (tmp_path / "checkpoints" / "final" / "unirl_checkpoint.json").exists()
