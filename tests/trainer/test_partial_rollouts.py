"""Partial rollouts in a real run (Ray, the tiny LM, one separate engine): rollouts in flight
pause at every weight sync and resume by the new weights, and a checkpoint taken with two of
them in flight resumes exactly. The stage-level math (tokens and log-probs of each version
against independent forwards) is tests/models/causal_lm/test_partial.py's."""

from __future__ import annotations

import json

import pytest

from tests.recipes import recipe, run, same_weights
from tests.trainer.test_dedicated_runs import training
from unirl.config.tree import ConfigError

pytestmark = pytest.mark.ray

RECIPE = "llm/tiny_lm_dedicated"
PARTIAL = [
    "rollout.placement=separate",
    "rollout.sleep_level=0",
    "rollout.max_staleness=2",
    "rollout.partial_tokens=4",
    "algorithm.config.old_logp_source=rollout",
    "checkpoint.every_n_steps=2",
]


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    return ray_cluster


def test_partial_rollouts_resume_by_each_new_version_and_from_a_checkpoint(tmp_path):
    """max_staleness 2, 4 tokens a segment (16 at most): step 0 samples on-policy; steps 1 and 2
    start by version 0 at step 0; step 1 is finished by version 0 (no sync between), step 2's
    samples pause after 4 tokens, resume by version 1 (synced at step 1) and finish by it; step 3
    starts by version 1 and resumes by version 2. So step 2's tokens are 1 to 2 versions behind,
    and some of its samples span two versions.

    Resume: the step-2 checkpoint holds the engine's weights (version 1) and both rollouts in
    flight (step 2's after its second segment, step 3's after its first) as they were; the run
    resumed from it writes the uninterrupted run's rows and weights. Resuming it without
    `partial_tokens` is refused before Ray, naming why."""
    full = run(RECIPE, tmp_path / "full", "num_steps=4", *PARTIAL)
    assert [r["rollout/staleness"] for r in full] == [0, 1, 2, 2]
    assert "rollout/token_staleness_mean" not in full[0]  # step 0: an ordinary on-policy rollout
    assert full[1]["rollout/token_staleness_mean"] == 1.0 and full[1]["rollout/resumed_frac"] == 0.0
    for r in full[2:]:
        assert 1.0 < r["rollout/token_staleness_mean"] < 2.0
        assert r["rollout/token_staleness_min"] == 1.0
        assert r["rollout/resumed_frac"] > 0.0
    synced = [r["step"] for r in full if r.get("sync/bytes", 0) > 0]
    assert synced == [1, 2, 3]  # every step syncs, rollouts in flight or not
    for r in full[1:]:
        assert r["off_policy/ratio_mean"] == r["ratio/first_update_mean"] != 1.0

    ckpt = tmp_path / "full" / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "driver_state.json").read_text())
    assert state["engine_weights_version"] == 1 and state["partial_versions"] == {"2": 0, "3": 1}
    assert (ckpt / "engine_drafts_0.pt").exists()
    whole = [o for o in PARTIAL if not o.startswith("rollout.partial_tokens")]
    with pytest.raises(
        ConfigError,
        match="taken with partial rollouts in flight but the recipe has rollout.partial_tokens=None",
    ):
        recipe(RECIPE, tmp_path / "wrong", "num_steps=4", *whole, f"resume_from={ckpt}")
    resumed = run(RECIPE, tmp_path / "resumed", "num_steps=4", *PARTIAL, f"resume_from={ckpt}")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [training(r) for r in resumed] == [training(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
