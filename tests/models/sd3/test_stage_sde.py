"""The stage's SDE strategy comes from `stage.sde`, a name in `SDE_STRATEGIES`."""

from __future__ import annotations

import pytest
import torch

from unirl.models.sd3 import SD3Stage
from unirl.sde import SDE_STRATEGIES, FlowSDEStrategy, StepOutput
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq


class CountingSDE(FlowSDEStrategy):
    """Flow-GRPO's SDE that counts its SDE steps (a stand-in for a new strategy)."""

    calls: list[tuple[float, int]] = []

    def step(self, x, v, sigmas, i, *, sde, noise=None, next_sample=None) -> StepOutput:
        if sde:
            CountingSDE.calls.append((self.eta, i))
        return super().step(x, v, sigmas, i, sde=sde, noise=noise, next_sample=next_sample)


def test_registered_strategy_runs_rollout_and_replay(monkeypatch, tiny_bundle) -> None:
    monkeypatch.setitem(SDE_STRATEGIES, "counting", CountingSDE)
    CountingSDE.calls = []
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=2,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.5,
        max_sequence_length=8,
        sde_scheduler="fixed",
        sde_steps=[1, 2],
    )
    sigmas = sigmas_for(sp, tiny_bundle.image_seq_len(16, 16))
    req = RolloutReq.from_prompts([PromptExample("a red square", "0")], sp, sigmas, 0)
    flow, counting = SD3Stage(tiny_bundle), SD3Stage(tiny_bundle, sde="counting")
    cond = counting.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    seg = counting.diffuse(req, cond)
    assert CountingSDE.calls == [(0.5, 1), (0.5, 2)]
    with torch.no_grad():
        lps, _, _ = counting.replay(seg, cond, [1, 2])
    assert CountingSDE.calls[2:] == [(0.5, 1), (0.5, 2)]
    # same numerics as the default "flow" strategy
    ref = flow.diffuse(req, cond)
    assert torch.equal(ref.latents, seg.latents) and torch.equal(ref.log_probs, seg.log_probs)
    assert torch.allclose(lps, seg.log_probs, atol=1e-5)


def test_default_strategy_is_flow(tiny_bundle) -> None:
    assert SD3Stage(tiny_bundle).sde == "flow"
    assert SDE_STRATEGIES["flow"] is FlowSDEStrategy


def test_unknown_strategy_names_the_key(tiny_bundle) -> None:
    with pytest.raises(ValueError, match=r"stage\.sde must be one of \['cps', 'dance', 'flow'\], got 'ddim'"):
        SD3Stage(tiny_bundle, sde="ddim")
