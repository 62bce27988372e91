"""DiffusionSamplingParams: SDE-step resolution and validation messages."""

from __future__ import annotations

import pytest

from unirl.types import DiffusionSamplingParams


def params(**kw: object) -> DiffusionSamplingParams:
    return DiffusionSamplingParams(**kw)  # type: ignore[arg-type]


def test_all_scheduler_uses_every_step() -> None:
    p = params(num_steps=10, sde_scheduler="all")
    for rid in (0, 1, 99):
        assert p.resolve_sde_indices(rid) == list(range(10))


def test_fixed_scheduler_sorted_and_deduplicated() -> None:
    p = params(num_steps=10, sde_scheduler="fixed", sde_steps=[7, 1, 7, 0])
    assert p.resolve_sde_indices(0) == [0, 1, 7]
    assert p.resolve_sde_indices(5) == [0, 1, 7]


def test_random_scheduler() -> None:
    p = params(num_steps=10, sde_scheduler="random", sde_num_steps=3, sde_window=(0.2, 0.8), seed=4)
    assert p.window_bounds() == (2, 8)
    draws = [p.resolve_sde_indices(rid) for rid in range(200)]
    for rid, d in enumerate(draws):
        assert len(d) == 3 and len(set(d)) == 3, d
        assert d == sorted(d)
        assert all(2 <= i < 8 for i in d), d
        # deterministic per rollout id, also through a fresh params object (another rank / replay)
        again = params(num_steps=10, sde_scheduler="random", sde_num_steps=3, sde_window=(0.2, 0.8), seed=4)
        assert again.resolve_sde_indices(rid) == d
    # differs across ids: C(6, 3) = 20 subsets, consecutive ids collide with prob ~1/20
    distinct = {tuple(d) for d in draws}
    assert len(distinct) >= 15
    collisions = sum(draws[i] == draws[i + 1] for i in range(len(draws) - 1))
    assert collisions < 40
    # the whole window is used and nothing outside it
    assert {i for d in draws for i in d} == set(range(2, 8))
    # the base seed changes the draw
    other = params(num_steps=10, sde_scheduler="random", sde_num_steps=3, sde_window=(0.2, 0.8), seed=5)
    assert [other.resolve_sde_indices(rid) for rid in range(200)] != draws


def test_random_scheduler_full_window_takes_all_steps() -> None:
    p = params(num_steps=10, sde_scheduler="random", sde_num_steps=9, sde_window=(0.0, 0.99))
    # flow_grpo's timestep fraction: int(10 * 0.99) = 9 trainable steps
    assert p.window_bounds() == (0, 9)
    assert p.resolve_sde_indices(3) == list(range(9))


def test_window_bounds_never_empty() -> None:
    p = params(num_steps=10, sde_scheduler="random", sde_window=(0.9, 0.95))
    assert p.window_bounds() == (9, 10)
    assert p.resolve_sde_indices(0) == [9]


def test_window_bounds_exact_fractions() -> None:
    p = params(num_steps=100, sde_scheduler="random", sde_window=(0.29, 0.57))
    assert p.window_bounds() == (29, 57)


@pytest.mark.parametrize("scheduler", ["all", "fixed", "random"])
def test_eta_zero_has_no_sde_steps(scheduler: str) -> None:
    p = params(num_steps=10, eta=0.0, sde_scheduler=scheduler, sde_steps=[1, 2])
    assert p.resolve_sde_indices(0) == []
    assert p.resolve_sde_indices(17) == []


def test_yaml_lists_are_normalised() -> None:
    p = params(sde_window=[0.1, 0.5], sde_steps=(1, 2), sde_scheduler="fixed")  # as OmegaConf passes them
    assert p.sde_window == (0.1, 0.5)
    assert p.sde_steps == [1, 2]


def test_do_cfg() -> None:
    assert params(guidance_scale=4.5).do_cfg
    assert not params(guidance_scale=1.0).do_cfg


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"num_steps": 0}, "sampling.num_steps"),
        ({"samples_per_prompt": 0}, "sampling.samples_per_prompt"),
        ({"eta": -0.1}, "sampling.eta"),
        ({"guidance_scale": 0.5}, "sampling.guidance_scale"),
        ({"sde_scheduler": "window"}, "sampling.sde_scheduler"),
        ({"sde_scheduler": "fixed", "sde_steps": []}, "sampling.sde_steps"),
        ({"sde_scheduler": "fixed", "num_steps": 10, "sde_steps": [10]}, "sampling.sde_steps"),
        ({"sde_scheduler": "fixed", "sde_steps": [-1]}, "sampling.sde_steps"),
        ({"sde_scheduler": "random", "sde_num_steps": 0}, "sampling.sde_num_steps"),
        (
            {"sde_scheduler": "random", "num_steps": 10, "sde_window": (0.0, 0.5), "sde_num_steps": 6},
            "sampling.sde_num_steps",
        ),
        ({"sde_scheduler": "random", "sde_window": (0.5, 0.5)}, "sampling.sde_window"),
        ({"sde_scheduler": "random", "sde_window": (0.6, 0.5)}, "sampling.sde_window"),
        ({"sde_scheduler": "random", "sde_window": (-0.1, 0.5)}, "sampling.sde_window"),
        ({"sde_scheduler": "random", "sde_window": (0.1, 1.5)}, "sampling.sde_window"),
    ],
)
def test_validation_names_the_key(kw: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        params(**kw)
    # the message names this key first, not another one
    assert str(info.value).startswith(key) or str(info.value).startswith(f"{key}=")


def test_sde_num_steps_message_names_the_window() -> None:
    with pytest.raises(ValueError) as info:
        params(sde_scheduler="random", num_steps=10, sde_window=(0.0, 0.5), sde_num_steps=6)
    msg = str(info.value)
    assert "[1, 5]" in msg and "sampling.sde_window" in msg and "[0, 5)" in msg


def test_validate_rechecks_after_mutation() -> None:
    p = params()
    p.eta = -1.0
    with pytest.raises(ValueError, match=r"sampling\.eta"):
        p.validate()
