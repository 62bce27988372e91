"""A row's group of demonstrations (offline preference pairs): each sample of a group replays its
own key's image, is labelled with it, and `PreferredDemonstration` ranks the chosen one first, so
DiffusionDPO pairs the data's chosen image against its rejected one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.diffusion_dpo import preference_pairs
from unirl.models.sd3 import SD3Stage
from unirl.reward.local.preference import PreferredDemonstration
from unirl.rollout.demonstrations import DemonstrationEngine
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq
from unirl.types.reward import RewardRequest


def _pairs_request(samples_per_prompt: int = 2, size: int = 16) -> RolloutReq:
    rng = np.random.default_rng(0)
    examples = [
        PromptExample(
            p,
            f"p{i}",
            {k: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for k in ("chosen", "rejected")},
        )
        for i, p in enumerate(["a red square", "two blue circles", "a green triangle"])
    ]
    sampling = DiffusionSamplingParams(
        num_steps=2,
        samples_per_prompt=samples_per_prompt,
        height=size,
        width=size,
        guidance_scale=1.0,
        eta=0.0,
        max_sequence_length=8,
    )
    return RolloutReq.from_prompts(examples, sampling, sigmas_for(sampling, (size // 4) ** 2), rollout_id=0)


@pytest.fixture(scope="module")
def stage() -> SD3Stage:
    torch.manual_seed(0)
    return SD3Stage(tiny_model_config().build())


def test_each_sample_of_a_group_replays_its_own_demonstration_and_is_labelled(stage):
    req = _pairs_request()
    track = DemonstrationEngine(stage, target_key=["chosen", "rejected"]).generate(req).track("diffusion")
    labels = [m["demonstration"] for m in track.metadata]
    assert labels == ["chosen", "rejected"] * 3
    for i, (meta, label) in enumerate(zip(req.metadata, labels, strict=True)):
        assert torch.equal(track.media[i].permute(1, 2, 0), torch.from_numpy(meta[label]))  # exact round trip
    assert all("demonstration" not in m for m in req.metadata)  # the request's rows are left as they were
    scores = PreferredDemonstration()(
        RewardRequest(sample_ids=track.sample_ids, prompts=track.prompts, images=track.media, metadata=track.metadata)
    )
    assert scores.tolist() == [1.0, 0.0] * 3
    assert preference_pairs(scores, track.group_ids) == ([0, 2, 4], [1, 3, 5], 0)  # DPO's winner: chosen


def test_a_group_larger_than_its_demonstrations_and_an_unlabelled_sample_are_named(stage):
    req = _pairs_request(samples_per_prompt=3)
    with pytest.raises(ValueError, match=r"sample '.*::sample:2': its group .* has more samples than"):
        DemonstrationEngine(stage, target_key=["chosen", "rejected"]).generate(req)
    unlabelled = RewardRequest(sample_ids=["s0"], prompts=["p"], images=torch.zeros(1, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="PreferredDemonstration reads each sample's metadata"):
        PreferredDemonstration()(unlabelled)
    unlabelled.metadata = [{"prompt_source": "x"}]
    with pytest.raises(ValueError, match=r"sample 's0' has no metadata\['demonstration'\]"):
        PreferredDemonstration()(unlabelled)
