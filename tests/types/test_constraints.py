"""Typed ranges: a field's declared range is checked where the config is built and by the recipe
validator, with one wording."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest
from annotated_types import Ge, Interval

from unirl.config.schema import check_node
from unirl.types.constraints import AtLeastOne, NonNegative, OpenUnit, Positive, check_fields, describe


@dataclass
class Toy:
    beta: Positive = 1.0
    kl: NonNegative = 0.0
    draws: AtLeastOne = 1
    clip: OpenUnit | None = None
    power: Annotated[float, Interval(gt=0, le=1)] = 0.5
    space: Literal["velocity", "noise"] = "velocity"
    cap: Annotated[float, Ge(1)] = 10.0

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("beta", 0.0, "algorithm.config.beta must be > 0, got 0.0"),
        ("beta", -1.5, "algorithm.config.beta must be > 0, got -1.5"),
        ("kl", -0.1, "algorithm.config.kl must be >= 0, got -0.1"),
        ("draws", 0, "algorithm.config.draws must be >= 1, got 0"),
        ("clip", 1.0, "algorithm.config.clip must be in (0, 1) or null, got 1.0"),
        ("power", 0.0, "algorithm.config.power must be in (0, 1], got 0.0"),
        ("power", 1.5, "algorithm.config.power must be in (0, 1], got 1.5"),
        ("space", "latent", "algorithm.config.space must be one of ['velocity', 'noise'], got 'latent'"),
        ("cap", 0.5, "algorithm.config.cap must be >= 1, got 0.5"),
    ],
)
def test_a_value_outside_its_declared_range_is_named_built_or_validated(field, value, expected) -> None:
    with pytest.raises(ValueError) as info:
        Toy(**{field: value})
    assert str(info.value) == expected
    _, problems = check_node("algorithm.config", Toy, {field: value})
    assert problems == [expected]  # the recipe validator words it the same


def test_bounds_hold_at_their_edges_and_null_where_allowed() -> None:
    Toy(beta=1e-12, kl=0.0, draws=1, clip=None, power=1.0, space="noise", cap=1.0)
    Toy(clip=0.5)
    instance, problems = check_node("algorithm.config", Toy, {"power": 1.0, "clip": None})
    assert problems == [] and instance.power == 1.0


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_float_bound_refuses_inf_and_nan(value) -> None:
    with pytest.raises(ValueError, match=r"algorithm.config.beta must be > 0, got (inf|nan)"):
        Toy(beta=value)


def test_a_bound_reads_the_same_whichever_spelling_typing_cached() -> None:
    # `Annotated[float, Ge(1)]` and `Annotated[float, Ge(1.0)]` are one cached object (the bounds
    # compare equal), so the spelling a field sees depends on import order.
    assert describe({"ge": 1.0}) == describe({"ge": 1}) == ">= 1"
    assert describe({"gt": 0.0, "le": 1.0}) == "in (0, 1]"
    assert describe({"ge": 0.5}) == ">= 0.5"
