"""The dedicated-engine recipes through their entry points, a few steps each on shrunken sizes.

The diffusion recipes' entry points run in tests/trainer/test_dedicated_runs.py: the colocated
one in the killed-engine test (its rows and placement up to the kill; its full run, in-process,
in the same module), the separate one in the staleness test (4 steps: staleness, syncs,
placement, export)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_module
from tests.recipes import LM
from tests.recipes import rows as read_rows

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

CASES = {
    "llm/tiny_lm_dedicated": ("unirl.train_vlm", LM, [0, 0]),
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
    rows = read_rows(tmp_path)
    assert [r["rollout/staleness"] for r in rows] == staleness
    assert all(r["sync/bytes"] > 0 for r in rows[: len(staleness) - 1])  # a sync before each later rollout
    placed = json.loads((tmp_path / "placement.json").read_text())
    assert [e["engine"] for e in placed["engines"]] == [0]
    assert (tmp_path / "checkpoints" / "final" / "unirl_checkpoint.json").exists()
