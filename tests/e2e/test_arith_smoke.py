"""The arithmetic world's RL recipe wiring, trained in this process (`python -m unirl.train_vlm` and
Ray run in tests/e2e/test_tiny_lm.py): a random tiny LM, 3 steps, held-out evaluation at steps
0, 2 and 3, text samples and per-operation curves in the gallery."""

from __future__ import annotations

import json

import pytest

from tests.recipes import IN_PROCESS, run
from worlds.arith import HELD_OUT_COMBOS

pytestmark = [pytest.mark.e2e]


def test_arith_smoke_recipe_runs_and_evaluates(tmp_path):
    rows = run("llm/arith_grpo_smoke", tmp_path, *IN_PROCESS, "logging.save_images_every=1")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in (rows[0], rows[2], rows[3]):
        assert {"eval/accuracy/greedy", "eval/accuracy/pass@1", "eval/accuracy/pass@4"} <= set(r)
        ops = {k.rsplit("=", 1)[1] for k in r if k.startswith("eval/accuracy/greedy/op=")}
        assert ops == {op for op, _ in HELD_OUT_COMBOS}
    assert all({"reward/answer/mean", "reward/format/mean"} <= set(r) for r in rows[1:])
    samples = json.loads((tmp_path / "samples" / "step_0003.json").read_text())
    assert len(samples) == 64 and all(s["prompt"].endswith("=") for s in samples)
    page = (tmp_path / "gallery.html").read_text()
    assert 'id="eval-chart-op"' in page and 'class="sample text"' in page
