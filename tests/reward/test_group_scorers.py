"""Group scorers: `PickScoreRank` ranks each image's PickScore among its group's; requests carry
group ids (the reward service sets them, the wire and the server's merging keep them); recipes
that would split groups are refused before Ray."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES
from tests.reward.tiny_clip import save_tiny_clip
from unirl.config.validate import ConfigError, validate_recipe
from unirl.reward import LocalRewardBackend
from unirl.reward.batching import merge_requests
from unirl.reward.local import PickScore, PickScoreRank
from unirl.reward.wire import decode_request, encode_request
from unirl.types.reward import RewardRequest

PROMPTS = ["a red cube", "two cats", "a photo", "the sun", "a blue ball", "a tree"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_clip(tmp_path_factory.mktemp("clip")))


def request(groups: list[str], seed: int = 0) -> RewardRequest:
    n = len(groups)
    images = torch.randint(
        0, 256, (n, 3, 40, 40), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    return RewardRequest([f"s{i}" for i in range(n)], PROMPTS[:n], images=images, group_ids=groups)


def ranks_by_hand(scores: list[float]) -> list[float]:
    """Each score's position in its group sorted ascending, over n - 1; ties share their mean."""
    n = len(scores)
    out = []
    for s in scores:
        below = sum(1 for t in scores if t < s)
        equal = sum(1 for t in scores if t == s) - 1
        out.append((below + equal / 2) / (n - 1))
    return out


def test_ranks_within_each_group(checkpoint) -> None:
    req = request(["g0", "g0", "g0", "g1", "g1", "g1"])
    raw = PickScore(checkpoint)(req).tolist()
    got = PickScoreRank(checkpoint)(req).tolist()
    assert got == pytest.approx(ranks_by_hand(raw[:3]) + ranks_by_hand(raw[3:]))
    assert sorted(got[:3]) == pytest.approx([0.0, 0.5, 1.0]) and sorted(got[3:]) == pytest.approx(
        [0.0, 0.5, 1.0]
    )


def test_equal_images_share_their_rank(checkpoint) -> None:
    req = request(["g0", "g0"])
    req.images[1] = req.images[0]
    req.prompts[1] = req.prompts[0]
    assert PickScoreRank(checkpoint)(req).tolist() == [0.5, 0.5]


@pytest.mark.parametrize(
    "groups, match",
    [
        ([], "carries no group ids"),
        (["g0", "g1", "g0", "g1"], "samples of group 'g0' are not contiguous"),
        (["g0", "g0", "g1"], "group 'g1' has one sample"),
    ],
)
def test_groups_it_cannot_rank_are_named(checkpoint, groups, match) -> None:
    req = request(groups or ["x"] * 4)
    if not groups:
        req.group_ids = []
    with pytest.raises(ValueError, match=match):
        PickScoreRank(checkpoint)(req)


def test_group_ids_cross_the_wire_and_merging_keeps_clients_apart(checkpoint) -> None:
    req = request(["g0", "g0", "g1", "g1"])
    assert decode_request(encode_request(req, "raw")).group_ids == ["g0", "g0", "g1", "g1"]
    merged = merge_requests([request(["g0", "g0"], 1), request(["g0", "g0"], 2)])
    assert merged.group_ids == ["0:g0", "0:g0", "1:g0", "1:g0"]  # one id, two clients: two groups
    assert len(merged.groups("test")) == 2
    assert (
        merge_requests([request(["g0", "g0"]), RewardRequest(["t"], ["p"], images=req.images[:1])]).group_ids
        == []
    )
    backend = LocalRewardBackend({"rank": PickScoreRank(checkpoint)})
    assert backend.score(merged).components["rank"].tolist() == pytest.approx(
        backend.score(request(["g0", "g0"], 1)).components["rank"].tolist()
        + backend.score(request(["g0", "g0"], 2)).components["rank"].tolist()
    )


def compose_with_rank(recipe: str, checkpoint: str, tmp_path, *overrides: str):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(
            recipe,
            [
                f"output_dir={tmp_path}",
                "~reward.backend.components.redness",
                "~reward.backend.weights",
                "+reward.backend.weights={rank: 1.0}",
                f"+reward.backend.components.rank={{_target_: unirl.reward.local.PickScoreRank, model_path: {checkpoint}}}",
                *overrides,
            ],
        )


def test_recipes_that_cannot_keep_groups_are_refused_before_ray(checkpoint, tmp_path) -> None:
    ok = compose_with_rank("diffusion/tiny_sd3_flowgrpo", checkpoint, tmp_path)
    validate_recipe(ok, expect="diffusion")
    one = compose_with_rank(
        "diffusion/tiny_sd3_flowgrpo", checkpoint, tmp_path, "sampling.samples_per_prompt=1",
        "train.stack.micro_batch_size=1", "algorithm._target_=unirl.algorithms.flow_grpo.FlowGRPO",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"components.rank scores each sample against its group's"):
        validate_recipe(one, expect="diffusion")
    split = compose_with_rank(
        "diffusion/tiny_sd3_dedicated_colocate", checkpoint, tmp_path, "rollout.forward_batch_size=4"
    )
    with pytest.raises(
        ConfigError, match=r"rollout.forward_batch_size=4 .* splits groups of sampling.samples_per_prompt=8"
    ):
        validate_recipe(split, expect="diffusion")
    whole = compose_with_rank("diffusion/tiny_sd3_dedicated_colocate", checkpoint, tmp_path)
    validate_recipe(whole, expect="diffusion")


def test_the_reward_service_scores_a_track_by_its_groups(checkpoint) -> None:
    from unirl.reward import RewardService
    from unirl.types import LatentSegment, RolloutTrack

    req = request(["g0", "g0", "g0", "g1", "g1", "g1"])
    seg = LatentSegment(
        latents=torch.zeros(6, 1, 1, 1, 1), positions=[1], sigmas=torch.tensor([1.0, 0.0]), sde_indices=[],
        log_probs=torch.zeros(6, 0), eta=0.0, guidance_scale=1.0,
    )  # fmt: skip
    track = RolloutTrack(
        name="diffusion", sample_ids=req.sample_ids, group_ids=req.group_ids, prompts=req.prompts,
        metadata=[{} for _ in range(6)], segment=seg, media=req.images,
    )  # fmt: skip
    RewardService(LocalRewardBackend({"rank": PickScoreRank(checkpoint)})).score_and_attach(track)
    assert track.rewards.tolist() == pytest.approx(PickScoreRank(checkpoint)(req).tolist())
