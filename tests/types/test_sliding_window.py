"""MixGRPO's sliding-window SDE scheduler on DiffusionSamplingParams: positions over rollouts
against a stateful reference loop (the shape of MixGRPO's GRPOTrainingStates), the random order,
determinism under resume, the ODE-solver knobs and bad inputs."""

from __future__ import annotations

import pytest

from unirl.sde.schedules import sigmas_for
from unirl.trainer.evaluation import EvalSampling, eval_request
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq


def sliding(**kw: object) -> DiffusionSamplingParams:
    base = dict(num_steps=10, sde_scheduler="sliding", sde_num_steps=4, sde_window=(0.0, 0.8))
    return DiffusionSamplingParams(**{**base, **kw})  # type: ignore[arg-type]


def reference_windows(rollouts: int, lo: int, hi: int, size: int, stride: int, iters: int, roll_back: bool):
    """A stateful loop: the window starts at lo, moves by `stride` after every `iters` rollouts,
    and past the last start that fits in [lo, hi) goes back to lo (roll back) or stays there."""
    last = hi - size
    cur, it, out = lo, 0, []
    for _ in range(rollouts):
        out.append(list(range(cur, cur + size)))
        it += 1
        if it == iters:
            it, cur = 0, cur + stride
            if cur > last:
                cur = lo if roll_back else last - (last - lo) % stride
    return out


@pytest.mark.parametrize("roll_back", [True, False])
@pytest.mark.parametrize(
    ("stride", "iters", "window"), [(1, 3, (0.0, 0.8)), (2, 1, (0.1, 1.0)), (3, 5, (0.0, 1.0))]
)
def test_progressive_positions_follow_the_reference_loop(stride, iters, window, roll_back) -> None:
    p = sliding(
        sde_stride=stride, sde_iters_per_window=iters, sde_window=window, sde_window_roll_back=roll_back
    )
    lo, hi = p.window_bounds()
    got = [p.resolve_sde_indices(r) for r in range(120)]
    assert got == reference_windows(120, lo, hi, 4, stride, iters, roll_back)


def test_progressive_mixgrpo_reference_settings() -> None:
    """T=10, window 4, stride 1 in steps [0, 8): positions 0..4, each held for 25 rollouts (MixGRPO's
    iters_per_group), then back to 0."""
    p = sliding(sde_iters_per_window=25)
    assert p.window_bounds() == (0, 8) and p.window_starts() == [0, 1, 2, 3, 4]
    assert p.resolve_sde_indices(0) == [0, 1, 2, 3]
    assert p.resolve_sde_indices(24) == [0, 1, 2, 3]
    assert p.resolve_sde_indices(25) == [1, 2, 3, 4]
    assert p.resolve_sde_indices(124) == [4, 5, 6, 7]
    assert p.resolve_sde_indices(125) == [0, 1, 2, 3]
    clamped = sliding(sde_iters_per_window=25, sde_window_roll_back=False)
    assert clamped.resolve_sde_indices(10_000) == [4, 5, 6, 7]


def test_random_order_holds_each_draw_for_its_iterations_and_is_seeded() -> None:
    p = sliding(sde_window_order="random", sde_iters_per_window=3, seed=7)
    starts = p.window_starts()
    got = [p.window_start(r) for r in range(600)]
    for w in range(200):  # one draw per block of 3 rollouts
        assert got[3 * w] == got[3 * w + 1] == got[3 * w + 2]
    blocks = got[::3]
    assert set(blocks) == set(starts)  # every position is drawn
    assert max(blocks.count(s) for s in starts) < 70  # about 40 each out of 200
    assert [p.resolve_sde_indices(r) for r in range(9)] == [list(range(s, s + 4)) for s in got[:9]]
    other = sliding(sde_window_order="random", sde_iters_per_window=3, seed=8)
    assert [other.window_start(r) for r in range(600)] != got


@pytest.mark.parametrize("order", ["progressive", "random"])
def test_a_resumed_run_slides_the_same_way(order: str) -> None:
    """The window is a function of (rollout id, seed): a fresh params object (a resumed run, another
    rank, the replay side) gives the same windows, also through RolloutReq, which pins them."""
    kw = dict(sde_window_order=order, sde_iters_per_window=2, seed=3)
    straight = [sliding(**kw).resolve_sde_indices(r) for r in range(40)]
    resumed = sliding(**kw)
    assert [resumed.resolve_sde_indices(r) for r in range(17, 40)] == straight[17:]
    sigmas = sigmas_for(resumed, 64)
    for r in (17, 30):
        req = RolloutReq.from_prompts([PromptExample("a red square", "0")], resumed, sigmas, r)
        assert req.sde_indices == straight[r]


def test_sliding_with_eta_zero_has_no_sde_steps() -> None:
    assert sliding(eta=0.0).resolve_sde_indices(5) == []


def test_possible_sde_steps() -> None:
    assert sliding().possible_sde_steps() == list(range(8))
    assert DiffusionSamplingParams(num_steps=6).possible_sde_steps() == list(range(6))
    fixed = DiffusionSamplingParams(num_steps=6, sde_scheduler="fixed", sde_steps=[4, 1, 4])
    assert fixed.possible_sde_steps() == [1, 4]
    rand = DiffusionSamplingParams(
        num_steps=10, sde_scheduler="random", sde_num_steps=2, sde_window=(0.2, 0.5)
    )
    assert rand.possible_sde_steps() == [2, 3, 4]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"num_steps": 10, "sde_num_steps": 12, "sde_window": (0.0, 1.0)},
            r"sampling\.sde_num_steps=12 \(the window size of sde_scheduler=sliding\) must be in \[1, 10\]",
        ),
        (
            {"sde_num_steps": 9},
            r"sampling\.sde_num_steps=9 .* covers steps \[0, 8\) of 10",
        ),
        ({"sde_stride": 0}, r"sampling\.sde_stride must be >= 1, got 0"),
        ({"sde_iters_per_window": 0}, r"sampling\.sde_iters_per_window must be >= 1, got 0"),
        (
            {"sde_window_order": "backwards"},
            r"sampling\.sde_window_order must be one of \['progressive', 'random'\]",
        ),
        ({"ode_solver": "rk4"}, r"sampling\.ode_solver must be one of \['euler', 'dpmpp_2m'\], got 'rk4'"),
        (
            {"noise_all_steps": True, "ode_solver": "dpmpp_2m"},
            r"sampling\.noise_all_steps=true .* sampling\.ode_solver='dpmpp_2m'",
        ),
    ],
)
def test_bad_inputs_name_the_key(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sliding(**kw)


def test_evaluation_samples_with_euler_whatever_the_training_layout() -> None:
    """Every recipe evaluates with Euler ODE steps: no SDE step, no second-order solver, no
    noise; a training window that does not fit the evaluation's steps is not an error."""
    train = sliding(ode_solver="dpmpp_2m", same_initial_noise=True)
    info = {"vae_scale_factor": 8, "patch_size": 8}
    req = eval_request([PromptExample("a red square", "0")], train, EvalSampling(num_steps=3), info)
    sp = req.sampling
    assert req.sde_indices == [] and sp.eta == 0.0 and sp.num_steps == 3
    assert sp.ode_solver == "euler" and not sp.noise_all_steps and not sp.same_initial_noise
    dance = DiffusionSamplingParams(
        num_steps=10, sde_scheduler="random", sde_num_steps=5, sde_window=(0.0, 0.9), noise_all_steps=True
    )
    assert not eval_request(
        [PromptExample("a red square", "0")], dance, EvalSampling(), info
    ).sampling.noise_all_steps
