"""Every recipe under `examples/` takes the command-line overrides the README documents.

Each recipe is composed offline (Hydra's compose API, nothing built) with all of them at once and
must hold the values given: every recipe, supervised ones included, takes `tracking=[...]`,
`num_steps`, `output_dir`, `num_devices`, `transport=<name>` and `resume_from`. Recipes are found
by globbing, so a new one is covered as it lands.
"""

from __future__ import annotations

import glob
import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import EXAMPLES

RECIPES = sorted(
    os.path.relpath(path, EXAMPLES)[: -len(".yaml")]
    for path in glob.glob(os.path.join(EXAMPLES, "*", "*.yaml"))
    if os.path.basename(os.path.dirname(path)) not in ("transport", "scorer")  # groups, not recipes
)
TRACKING = ["tensorboard", "console"]
# the override and the (key, value) it must leave in the composed recipe; tq_simple is no
# recipe's default transport, so every recipe's group is really switched
RL_OVERRIDES = {
    f"tracking=[{','.join(TRACKING)}]": ("tracking", TRACKING),
    "num_steps=2": ("num_steps", 2),
    "output_dir=/tmp/unirl_override": ("output_dir", "/tmp/unirl_override"),
    "num_devices=2": ("num_devices", 2),
    "transport=tq_simple": ("transport.name", "tq_simple"),
    "resume_from=latest": ("resume_from", "latest"),
}
def compose_recipe(name: str, overrides: list[str]):
    """`examples/<name>.yaml` composed with `overrides`, unresolved (no `${oc.env:...}` read)."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(config_name=name, overrides=overrides)


def test_recipes_are_found() -> None:
    assert "diffusion/sd3_flowgrpo" in RECIPES and "diffusion/shapes_sft" in RECIPES
    assert not any(name.startswith("transport/") for name in RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_takes_the_documented_overrides(name: str) -> None:
    cfg = compose_recipe(name, list(RL_OVERRIDES))
    for override, (key, value) in RL_OVERRIDES.items():
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == value, f"{name}: {override} left {key}={got!r}"
