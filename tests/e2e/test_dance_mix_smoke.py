"""The DanceGRPO and MixGRPO smoke recipes trained in this process (no Ray), and their bad
inputs refused by the entry point before any worker starts."""

from __future__ import annotations

import pytest

from tests.conftest import run_module
from tests.recipes import run

pytestmark = [pytest.mark.e2e]


@pytest.mark.parametrize("name", ["shapes_dancegrpo_smoke", "shapes_mixgrpo_smoke"])
def test_smoke_recipe_trains(name: str, tmp_path) -> None:
    rows = run(f"diffusion/{name}", tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/geneval/mean"] <= 1.0
        # pi_old is the rollout's log-probs under the same weights: on-policy ratio ~ 1
        assert abs(r["ratio/first_update_mean"] - 1.0) < 1e-4
    assert (tmp_path / "checkpoints" / "final").is_dir()


def test_bad_window_is_refused_before_any_work(tmp_path) -> None:
    res = run_module(
        "unirl.train_diffusion",
        "--config-name=diffusion/shapes_mixgrpo_smoke",
        "sampling.sde_stride=0",
        f"output_dir={tmp_path}",
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert "sampling.sde_stride must be >= 1, got 0" in res.stderr  # the rest: tests/config/test_dance_mix_recipes.py
    assert not (tmp_path / "metrics.jsonl").exists()
