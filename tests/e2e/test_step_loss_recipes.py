"""The tiny DDPO, DPOK, Flow-DPPO and Diffusion-DPO recipes trained a few steps each, in this
process with the inband data plane (shrunk: 2 prompts x 8 samples, 4 denoising steps), and what
each writes that only it writes. (`python -m unirl.train_diffusion` runs in
tests/e2e/test_tiny_recipe.py and tests/e2e/test_launchers.py.)"""

from __future__ import annotations

import math

import pytest

from tests.recipes import IN_PROCESS, run

pytestmark = [pytest.mark.e2e]

SHRINK = [*IN_PROCESS, "num_steps=2", "prompts_per_rollout=2", "sampling.num_steps=4"]

# the random-step recipes draw 4 of 10 SDE steps: 2 of the shrunk 4
EXTRA = {"tiny_sd3_dpok": ["sampling.sde_num_steps=2"], "tiny_sd3_flowdppo": ["sampling.sde_num_steps=2"]}

OWN_KEYS = {
    "tiny_sd3_ddpo": {"ddpo/adv_clipped_frac", "clipfrac", "ratio/first_update_mean"},
    "tiny_sd3_dpok": {"kl", "kl/coef", "kl/coef_next", "clipfrac", "ratio/first_update_mean"},
    "tiny_sd3_flowdppo": {"dppo/kl_old", "dppo/masked_frac", "ratio/first_update_mean"},
    "tiny_sd3_diffusiondpo": {"dpo/pairs", "dpo/implicit_acc", "dpo/margin"},
}


@pytest.mark.parametrize("name", sorted(OWN_KEYS))
def test_tiny_recipe_trains(name, tmp_path):
    rows = run(f"diffusion/{name}", tmp_path, *SHRINK, *EXTRA.get(name, []))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert OWN_KEYS[name] <= set(r), OWN_KEYS[name] - set(r)
        assert math.isfinite(r["loss"]) and r["train/skipped_step"] == 0
    if "ratio/first_update_mean" in OWN_KEYS[name]:
        assert all(abs(r["ratio/first_update_mean"] - 1.0) < 1e-4 for r in rows)
    if name == "tiny_sd3_dpok":  # the adaptive coefficient carries over from one step to the next
        assert rows[1]["kl/coef"] == pytest.approx(rows[0]["kl/coef_next"])
    if name == "tiny_sd3_diffusiondpo":  # 2 groups of 8 colour rewards: a pair each
        assert all(r["dpo/pairs"] == 2.0 for r in rows)
