"""`python -m unirl.train` runs any recipe: the kind is read from the recipe (`recipe_kind`), and
the four named entry points are the same function with the kind they expect."""

from __future__ import annotations

import json

import pytest

from tests.config.test_recipe_overrides import RECIPES, compose_recipe
from tests.conftest import run_module
from unirl.config.validate import KINDS, recipe_kind, validate_recipe

BY_FOLDER = {"pe": "composed", "unified": "unified"}  # every other folder: single-track


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_is_of_its_folders_kind(name: str) -> None:
    assert recipe_kind(compose_recipe(name, [])) == BY_FOLDER.get(name.split("/")[0], "single")


def test_an_unknown_kind_is_refused() -> None:
    assert set(KINDS) == {"single", "composed", "unified"}
    with pytest.raises(ValueError, match=r"recipe kind must be one of \['single', 'composed', 'unified'\]"):
        validate_recipe(compose_recipe("pe/tiny_pe_smoke", []), kind="chain")


def test_python_m_unirl_train_runs_a_single_track_recipe(tmp_path) -> None:
    res = run_module(
        "unirl.train",
        "--config-name=llm/tiny_lm_grpo",
        "launcher=in_process",
        "transport=inband",
        "num_steps=2",
        f"output_dir={tmp_path}",
        "logging.progress=false",
        "logging.save_images_every=0",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)


@pytest.mark.parametrize(
    "recipe, override, named",
    [
        ("pe/tiny_pe_smoke", "tracks.ar.aggregate=median", "aggregate must be one of"),
        ("unified/tiny_bicot_smoke", "num_steps=0", "num_steps"),
        ("diffusion/tiny_sd3_flowgrpo", "sampling.samples_per_prompt=0", "samples_per_prompt"),
    ],
)
def test_python_m_unirl_train_validates_each_kind_before_ray(recipe, override, named, tmp_path) -> None:
    res = run_module("unirl.train", f"--config-name={recipe}", override, f"output_dir={tmp_path}", timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "error:" in res.stderr and named in res.stderr
    assert not (tmp_path / "config.yaml").exists()  # nothing ran
