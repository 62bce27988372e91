"""The DanceGRPO and MixGRPO recipes: what they compose to, and their sampling mistakes named
before Ray (window too large for the steps, stride 0, unknown SDE, CPS on its noiseless last step)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES
from unirl.config.validate import ConfigError, validate_recipe


def recipe(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(config_name=name, overrides=overrides or [])


def problems(name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe(name, overrides), expect="diffusion")
    return str(info.value)


def test_recipes_keep_flowgrpos_budget_and_change_only_the_sampling() -> None:
    base = recipe("diffusion/shapes_flowgrpo")
    for name in ("diffusion/shapes_dancegrpo", "diffusion/shapes_mixgrpo"):
        cfg = recipe(name)
        for key in ("num_steps", "prompts_per_rollout", "algorithm", "train", "advantage", "eval", "reward"):
            assert cfg[key] == base[key], (name, key)
    dance = recipe("diffusion/shapes_dancegrpo")
    assert dance.stage.sde == "dance" and dance.sampling.noise_all_steps and dance.sampling.same_initial_noise
    mix = recipe("diffusion/shapes_mixgrpo")
    assert mix.stage.sde == "flow" and mix.sampling.sde_scheduler == "sliding"
    for name in ("dancegrpo", "mixgrpo"):  # the shapes recipes read the committed base's config
        validate_recipe(recipe(f"diffusion/shapes_{name}"), expect="diffusion")
        validate_recipe(recipe(f"diffusion/shapes_{name}_smoke"), expect="diffusion")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["sampling.sde_num_steps=5"],
            "sampling.sde_num_steps=5 (the window size of sde_scheduler=sliding) must be in [1, 4]",
        ),
        (["sampling.sde_num_steps=7", "sampling.sde_window=[0.0,1.0]"], "must be in [1, 6]"),
        (["sampling.sde_stride=0"], "sampling.sde_stride must be >= 1, got 0"),
        (["sampling.sde_iters_per_window=0"], "sampling.sde_iters_per_window must be >= 1, got 0"),
        (["sampling.sde_window_order=shuffled"], "sampling.sde_window_order must be one of"),
        (["stage.sde=ddim"], "stage.sde must be one of ['cps', 'dance', 'flow'], got 'ddim'"),
        (["stage.sde=cps", "sampling.eta=1.5"], "sampling.eta must be in [0, 1] for stage.sde=cps"),
        (
            ["stage.sde=cps", "sampling.sde_window=[0.0,1.0]"],
            "stage.sde=cps has no noise on step(s) [5] (sigma' = 0)",
        ),
        (["+sampling.noise_all_steps=true"], "sampling.noise_all_steps=true makes every step stochastic"),
    ],
)
def test_sampling_mistakes_are_named_before_ray(overrides: list[str], message: str) -> None:
    assert message in problems("diffusion/shapes_mixgrpo_smoke", overrides)


def test_cps_is_accepted_where_the_window_keeps_off_the_last_step() -> None:
    validate_recipe(recipe("diffusion/shapes_mixgrpo_smoke", ["stage.sde=cps"]), expect="diffusion")
    msg = problems("diffusion/shapes_dancegrpo_smoke", ["stage.sde=cps", "sampling.sde_scheduler=all"])
    assert "stage.sde=cps has no noise on step(s) [5]" in msg
