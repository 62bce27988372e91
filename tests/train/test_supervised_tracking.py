"""Trackers in the supervised loop (`SupervisedRun.run(recipe=...)`, what `unirl.train_sft`
passes): the recipe's `tracking` list gets every log row at its step and the recipe as run
metadata, beside the run's own log (its `log_name`), read back with TensorBoard's reader; and
an SFT recipe's `tracking` is checked before any work, as an RL recipe's."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from unirl.config.validate import ConfigError, validate_sft_config
from unirl.tracking.metrics import read_rows
from unirl.train.supervised import SupervisedConfig, SupervisedRun


class LineFit(SupervisedRun):
    """y = 3x fitted by one weight: a supervised run in milliseconds."""

    log_name = "fit_log.jsonl"

    def batch_loss(self):
        x = torch.as_tensor(self.rng.normal(size=(4, 1)), dtype=torch.float32)
        return (self.modules[0](x) - 3 * x).square().mean(), {}


def test_supervised_rows_reach_the_recipes_trackers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    cfg = SupervisedConfig(num_steps=4, batch_size=4, lr=0.1, log_every=2, checkpoint_every=4)
    recipe = OmegaConf.create({"sft": {"lr": 0.1}, "tracking": ["tensorboard"], "hydra": {"x": 1}})
    rows = LineFit([torch.nn.Linear(1, 1, bias=False)], cfg, str(tmp_path)).run(recipe=recipe)
    logged, problems = read_rows(str(tmp_path / "fit_log.jsonl"))
    assert logged == rows and [r["step"] for r in rows] == [2, 4] and not problems
    assert not (tmp_path / "metrics.jsonl").exists()  # the run's own log name, not the RL one
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for key in ("loss", "lr", "step_s"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.1' in config and "hydra" not in config


def test_sft_recipe_tracking_is_checked_before_any_work(tmp_path):
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "tracking": ["tensorbord"]})
    with pytest.raises(ConfigError) as err:
        validate_sft_config(cfg)  # the missing sections are named too; the tracker is checked anyway
    assert any(p.startswith("tracking[0].name: unknown tracker 'tensorbord'") for p in err.value.problems)
