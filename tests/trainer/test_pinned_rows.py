"""The diffusion recipes keep producing the metrics they produced before the trainer became generic.

`data/tiny_flowgrpo_rows.json` holds the rows (times and process memory left out) of a shrunken
tiny Flow-GRPO run, written by the diffusion-only trainer of commit bfe83b8 (before the driver loop
served text). The same run today must give the same rows: rewards, losses, ratios, gradient norms,
bytes moved. Floats are compared to 1e-6 relative (same arithmetic; the tolerance only absorbs a
different CPU's kernels) or 1e-7 absolute, fp32's epsilon, for values that are 0 up to rounding
(the on-policy first update's loss, -mean(A) over group-centred advantages: 1.5e-8 pinned, 3.0e-8
on an AVX-512 machine), integers and keys exactly. A metric the run logs that the old trainer did
not is added to the file with the run's value (`adv_clipped_frac`: 0, no advantage beyond the
clip), so every other value still comes from commit bfe83b8.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import untimed
from tests.recipes import IN_PROCESS, recipe
from unirl.trainer.trainer import Trainer

PINNED = os.path.join(os.path.dirname(__file__), "data", "tiny_flowgrpo_rows.json")
# the shrunk tiny recipe (tests/recipes.py) in this process, 3 steps
RECIPE = [*IN_PROCESS, "num_steps=3", "threads_per_worker=1"]


def test_tiny_flowgrpo_rows_are_unchanged(tmp_path):
    cfg = recipe("diffusion/tiny_sd3_flowgrpo", tmp_path, *RECIPE, expect="diffusion")
    raw = Trainer(cfg).run()
    # threads_per_worker fixes the count: no governor, no load figure
    assert all(r["cpu/threads"] == 1 and "cpu/others_load" not in r for r in raw)
    rows = [untimed(r) for r in raw]
    with open(PINNED) as f:
        pinned = json.load(f)
    assert len(rows) == len(pinned) == 3
    for got, want in zip(rows, pinned, strict=True):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (got["step"], key)
            else:
                assert got[key] == value, (got["step"], key)
