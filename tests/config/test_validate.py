"""Recipe composition and every validator error, before any Ray work."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES, run_module
from unirl.config.validate import ConfigError, validate_diffusion_config

RECIPES = ["diffusion/tiny_sd3_flowgrpo", "diffusion/sd3_flowgrpo"]


def recipe(name: str = "diffusion/tiny_sd3_flowgrpo", overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(config_name=name, overrides=overrides or [])


def problems_of(overrides: list[str], name: str = "diffusion/tiny_sd3_flowgrpo") -> str:
    with pytest.raises(ConfigError) as info:
        validate_diffusion_config(recipe(name, overrides))
    return str(info.value)


def test_tiny_recipe_composes_and_validates():
    cfg = recipe()
    validate_diffusion_config(cfg)
    assert cfg.num_devices == 1 and cfg.num_steps == 30
    assert cfg.sampling.samples_per_prompt * cfg.prompts_per_rollout == 32


def test_real_recipe_composes_and_names_missing_model(monkeypatch):
    monkeypatch.setenv("PRETRAINED_MODEL", "/nonexistent/sd3.5-medium")
    msg = problems_of([], name="diffusion/sd3_flowgrpo")
    assert "model.pretrained_path" in msg and "/nonexistent/sd3.5-medium" in msg


def test_batch_geometry_not_divisible_by_devices():
    msg = problems_of(["num_devices=3"])
    assert "prompts_per_rollout (4) x sampling.samples_per_prompt (8) = 32" in msg and "num_devices=3" in msg


def test_micro_batch_must_divide_per_rank_batch():
    msg = problems_of(["train.stack.micro_batch_size=5"])
    assert "train.stack.micro_batch_size=5" in msg and "per-rank batch of 32" in msg


def test_multi_update_with_algorithm_that_forbids_it():
    msg = problems_of(
        [
            "algorithm._target_=unirl.algorithms.base.StageAlgorithm",
            "~algorithm.config",
            "train.stack.num_updates_per_batch=2",
        ]
    )
    assert "train.stack.num_updates_per_batch=2" in msg and "StageAlgorithm" in msg


def test_unknown_target_names_the_key():
    msg = problems_of(["reward.backend.components.redness._target_=unirl.reward.local.color.NoSuchScorer"])
    assert "reward.backend.components.redness._target_" in msg and "NoSuchScorer" in msg


def test_missing_model_path():
    msg = problems_of(["model.pretrained_path=/does/not/exist"])
    assert "model.pretrained_path" in msg and "/does/not/exist" in msg


def test_component_errors_name_their_key():
    msg = problems_of(["sampling.sde_num_steps=50", "train.optim.lr_schedule=zigzag"])
    assert "sampling" in msg and "sde_num_steps=50" in msg
    assert "train.optim" in msg and "zigzag" in msg


def test_eta_zero_with_flow_grpo():
    msg = problems_of(["sampling.eta=0.0"])
    assert "sampling.eta=0" in msg and "FlowGRPO" in msg


def test_missing_top_level_key():
    msg = problems_of(["~prompts_per_rollout"])
    assert "prompts_per_rollout" in msg


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("unirl.train_diffusion", *args, timeout=120, env=env)


def test_cli_rejects_bad_recipe_with_exit_code_and_message(tmp_path):
    res = run_cli("--config-name=diffusion/tiny_sd3_flowgrpo", "num_devices=3", f"output_dir={tmp_path}")
    assert res.returncode == 2
    assert "num_devices=3" in res.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", RECIPES)
def test_cli_cfg_job_resolve_works_offline(name):
    res = run_cli(f"--config-name={name}", "--cfg", "job", "--resolve", env={"PRETRAINED_MODEL": "/some/dir"})
    assert res.returncode == 0, res.stderr
    assert "num_devices:" in res.stdout and "_target_: unirl.algorithms.flow_grpo.FlowGRPO" in res.stdout


@pytest.mark.parametrize("name", ["inband", "ray", "tq_simple", "tq_mooncake"])
def test_every_transport_composes_and_validates(name):
    cfg = recipe(overrides=[f"transport={name}"])
    validate_diffusion_config(cfg)
    assert cfg.transport.name == name


def test_unknown_transport_name_lists_the_choices():
    msg = problems_of(["transport.name=carrier_pigeon"])
    assert "transport.name: unknown transport 'carrier_pigeon'" in msg and "tq_mooncake" in msg


def test_missing_transport_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # as if the extra were not installed
    msg = problems_of(["transport=tq_simple"])
    assert "transport=tq_simple" in msg and 'pip install -e ".[transferqueue]"' in msg


def test_bad_transport_option_fails_before_ray():
    from unirl.dataplane import DataPlaneError, make_transport

    with pytest.raises(ValueError, match="num_storage_units must be >= 1"):
        make_transport({"name": "tq_simple", "num_storage_units": 0})
    with pytest.raises(ValueError, match="master_address and transport.metadata_server go together"):
        make_transport({"name": "tq_mooncake", "master_address": "127.0.0.1:1"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_storage_units'"):
        make_transport({"name": "ray", "num_storage_units": 1})
    with pytest.raises(DataPlaneError, match="unknown transport"):
        make_transport({"name": "nope"})


def test_bad_transport_options_are_config_errors():
    msg = problems_of(["transport=tq_simple", "transport.num_storage_units=0"])
    assert "transport (tq_simple): transport.num_storage_units must be >= 1, got 0" in msg
    msg = problems_of(["+transport.bogus=1"])
    assert "transport (ray)" in msg and "bogus" in msg
