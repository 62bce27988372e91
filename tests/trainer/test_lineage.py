"""Lineage of composed rollouts: child requests, parent links, reward propagation and per-track
advantages, against hand computation."""

from __future__ import annotations

import pytest
import torch

from unirl.algorithms.advantages import track_advantages
from unirl.trainer.graph import aggregate_children
from unirl.types import (
    AdvantageConfig,
    DiffusionSamplingParams,
    PromptExample,
    RolloutReq,
    TextSamplingParams,
)
from unirl.types.lineage import child_request
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


def parent_track(n_prompts: int = 2, n: int = 3) -> RolloutTrack:
    examples = [
        PromptExample(f"user {g}", f"u{g}", {"canonical": f"a red circle {g}"}) for g in range(n_prompts)
    ]
    req = RolloutReq.from_prompts(examples, TextSamplingParams(samples_per_prompt=n), None, rollout_id=5)
    b = len(req)
    seg = TokenSegment(
        prompt_ids=[torch.tensor([1, 2])] * b,
        response_ids=[torch.tensor([3, 4, 5])] * b,
        log_probs=[torch.zeros(3)] * b,
    )
    return RolloutTrack(
        name="ar",
        sample_ids=req.sample_ids,
        group_ids=req.group_ids,
        prompts=req.prompts,
        metadata=req.metadata,
        segment=seg,
        texts=[f"rewrite {i}" for i in range(b)],
        rollout_id=5,
    )


def child_track(parent: RolloutTrack, m: int, rewards: list[float]) -> RolloutTrack:
    sampling = DiffusionSamplingParams(num_steps=4, samples_per_prompt=m, eta=0.0)
    req = child_request(parent, parent.texts, sampling, torch.linspace(1, 0, 5), rollout_id=5)
    track = RolloutTrack(
        name="diffusion",
        sample_ids=req.sample_ids,
        group_ids=req.group_ids,
        prompts=req.prompts,
        metadata=req.metadata,
        segment=None,
        rewards=torch.tensor(rewards),
        parent_ids=req.parent_ids,
        root_ids=req.root_ids,
    )
    return track


def test_child_request_layout_and_metadata() -> None:
    parent = parent_track(2, 3)
    sampling = DiffusionSamplingParams(num_steps=4, samples_per_prompt=2, eta=0.0)
    req = child_request(parent, parent.texts, sampling, torch.linspace(1, 0, 5), rollout_id=5)
    assert len(req) == 12
    assert req.sample_ids[:3] == [
        f"{parent.sample_ids[0]}/0",
        f"{parent.sample_ids[0]}/1",
        f"{parent.sample_ids[1]}/0",
    ]
    assert req.group_ids[:4] == [parent.sample_ids[0]] * 2 + [parent.sample_ids[1]] * 2  # a rewrite's images
    assert req.prompts[2] == "rewrite 1"  # the rewrite is the diffusion prompt
    assert req.metadata[2] == {"canonical": "a red circle 0", "user_prompt": "user 0", "rewrite": "rewrite 1"}
    assert len(set(req.seeds)) == 12


def test_child_seeds_do_not_depend_on_the_split() -> None:
    parent = parent_track(2, 2)
    sampling = DiffusionSamplingParams(num_steps=4, samples_per_prompt=3, eta=0.0)
    whole = child_request(parent, parent.texts, sampling, torch.linspace(1, 0, 5), 5)
    halves = [child_request(p, p.texts, sampling, torch.linspace(1, 0, 5), 5) for p in parent.split(2)]
    assert whole.seeds == halves[0].seeds + halves[1].seeds
    assert whole.sample_ids == halves[0].sample_ids + halves[1].sample_ids


def test_child_request_names_parent_and_root() -> None:
    """The request carries the lineage (engines copy it into their track); a grandchild's root
    is its grandparent's group, and a shard of the request keeps its samples' lineage."""
    parent = parent_track(2, 2)
    sampling = DiffusionSamplingParams(num_steps=4, samples_per_prompt=2, eta=0.0)
    req = child_request(parent, parent.texts, sampling, torch.linspace(1, 0, 5), rollout_id=5)
    assert req.parent_ids == [parent.sample_ids[i // 2] for i in range(8)]
    assert req.root_ids == [parent.group_ids[i // 2] for i in range(8)]
    assert len(set(req.root_ids)) == 2  # two user prompts
    assert req.split(2)[1].root_ids == req.root_ids[4:]
    middle = RolloutTrack(
        name="mid", sample_ids=req.sample_ids, group_ids=req.group_ids, prompts=req.prompts,
        metadata=req.metadata, segment=None, texts=req.prompts, root_ids=req.root_ids,
    )
    text = TextSamplingParams(samples_per_prompt=1)
    grand = child_request(middle, middle.texts, text, None, rollout_id=5)
    assert grand.parent_ids == middle.sample_ids and grand.root_ids == req.root_ids


@pytest.mark.parametrize("how", ["mean", "max", "min"])
def test_aggregate_matches_hand_computation(how: str) -> None:
    parent = parent_track(1, 3)
    rewards = [0.1, 0.5, 0.9, 0.9, 0.0, 0.2]  # 3 rewrites x 2 images
    child = child_track(parent, 2, rewards)
    by_hand = {
        "mean": [0.3, 0.9, 0.1],
        "max": [0.5, 0.9, 0.2],
        "min": [0.1, 0.9, 0.0],
    }[how]
    assert torch.allclose(aggregate_children(parent, child, how), torch.tensor(by_hand))


def test_per_track_advantages_by_hand() -> None:
    """Each track normalises within its own groups: images within a rewrite, rewrites within a
    user prompt (GRPO z-score, population std, eps 0)."""
    parent = parent_track(1, 3)
    child = child_track(parent, 2, [0.1, 0.5, 0.9, 0.9, 0.0, 0.2])
    cfg = AdvantageConfig(estimator="grpo", scope="group", eps=1e-12)
    child_adv = track_advantages(child, cfg)
    assert torch.allclose(child_adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-6)
    parent.rewards = aggregate_children(parent, child, "mean")
    r = torch.tensor([0.3, 0.9, 0.1])
    z = (r - r.mean()) / r.std(unbiased=False)
    assert torch.allclose(track_advantages(parent, cfg), z, atol=1e-5)


def test_missing_parent_and_childless_parent_are_errors() -> None:
    parent = parent_track(1, 2)
    child = child_track(parent, 2, [0.0, 1.0, 0.5, 0.5])
    child.parent_ids = [*child.parent_ids[:3], "nope::sample:9"]
    with pytest.raises(ValueError, match=r"nope::sample:9.*not in the batch"):
        aggregate_children(parent, child, "mean")
    try:
        aggregate_children(parent, child, "mean")
    except ValueError as e:
        assert child.sample_ids[3] in str(e)  # the child's id too
    child = child_track(parent, 2, [0.0, 1.0, 0.5, 0.5]).select([0, 1])
    with pytest.raises(ValueError, match=r"have no child"):
        aggregate_children(parent, child, "mean")
    with pytest.raises(ValueError, match=r"mean.*max.*min"):
        aggregate_children(parent, child_track(parent, 2, [0.0] * 4), "median")
