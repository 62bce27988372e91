"""A model directory's scheduler config is accepted only if our schedules reproduce it."""

from __future__ import annotations

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from unirl.models.flow.loading import check_scheduler_config


def test_sd3_scheduler_configs_are_accepted() -> None:
    for config in (
        FlowMatchEulerDiscreteScheduler(shift=3.0).config,
        FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).config,
    ):
        check_scheduler_config(dict(config), "model/scheduler")


@pytest.mark.parametrize(
    "option",
    [
        {"num_train_timesteps": 500},
        {"shift_terminal": 0.1},
        {"use_karras_sigmas": True},
        {"invert_sigmas": True},
    ],
)
def test_unreproduced_options_are_refused(option: dict) -> None:
    config = dict(FlowMatchEulerDiscreteScheduler(shift=3.0).config) | option
    with pytest.raises(
        ValueError, match=r"model/scheduler/scheduler_config\.json sets \{'" + next(iter(option))
    ):
        check_scheduler_config(config, "model/scheduler")
