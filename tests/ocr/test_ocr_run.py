"""`diffusion/ocr_flowgrpo` on the committed text-drawing base, two short steps in this process:
rollouts at 32x64 rewarded by PP-OCRv4, the held-out evaluation before and after, and the first
update on-policy (ratio 1 to replay rounding)."""

from __future__ import annotations

import pytest

from tests.recipes import IN_PROCESS, run

pytestmark = [pytest.mark.e2e]

SMALL = [
    "num_steps=2",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "eval.examples.limit=4",
    "eval.sampling.samples_per_prompt=1",
    "eval.every_n_steps=2",
    "train.stack.micro_batch_size=8",
]


def test_two_steps_are_rewarded_by_the_ocr_model_and_evaluated(tmp_path):
    rows = run("diffusion/ocr_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the base's evaluation
    trained = [r for r in rows if "reward/ocr/mean" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(0.0 <= r["reward/ocr/mean"] <= 1.0 for r in trained)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval/accuracy"] <= r["eval/ocr"] <= 1.0 for r in evals)
    first = trained[0]  # on-policy: the replayed log-probs are the rollout's to rounding
    assert max(abs(first["ratio/max"] - 1.0), abs(first["ratio/min"] - 1.0)) < 1e-5
