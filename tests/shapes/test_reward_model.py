"""The learned shapes reward: prompt codes, the network, the scorer / differentiable contract,
its training data, and its committed agreement with the weight-free scorer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from unirl.shapes import GenEvalMini, ShapesDataset, parse_prompt, scene_to_prompt
from unirl.shapes.reward_data import blur, label, near_miss, perturb, synth_batch
from unirl.shapes.reward_model import (
    HEADS,
    SCENE_DIM,
    RewardNet,
    RewardNetConfig,
    ShapesRewardModel,
    encode_scene,
    head_mask,
    save_reward_net,
)
from unirl.types.reward import DifferentiableReward, RewardRequest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED = os.path.join(REPO, "checkpoints", "shapes_reward")


def test_scene_code_by_hand():
    code = encode_scene(parse_prompt("a red circle left of a blue square"))
    expected = (
        [0, 0, 0, 1]  # category: position
        + [1, 0, 0, 0, 1, 0, 0]  # A: red, circle
        + [0, 0, 1, 0, 0, 1, 0]  # B: blue, square
        + [0, 1, 0]  # two objects drawn
        + [1, 0, 0, 0]  # left of
    )
    assert code.tolist() == expected and len(expected) == SCENE_DIM
    counting = encode_scene(parse_prompt("three yellow triangles"))
    assert counting[[2, 7, 10, 18 + 2]].tolist() == [1, 1, 1, 1] and counting.sum() == 4
    assert head_mask(parse_prompt("three yellow triangles")).tolist() == [1, 1, 1, 1, 0]
    assert head_mask(parse_prompt("a red circle")).tolist() == [1, 1, 1, 0, 0]


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    net = RewardNet(RewardNetConfig(channels=(4, 8, 8, 8), hidden=16))
    save_reward_net(net, str(tmp_path), {"note": "test"})
    return net, str(tmp_path)


def test_save_load_and_the_two_scoring_paths_agree(saved):
    net, path = saved
    model = ShapesRewardModel(path)
    assert isinstance(model, DifferentiableReward)
    assert json.load(open(os.path.join(path, "config.json")))["note"] == "test"
    images, prompts = ShapesDataset("train").sample_batch(6, np.random.default_rng(0))
    u8 = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    req = RewardRequest(sample_ids=[f"s{i}" for i in range(6)], prompts=prompts, images=u8)
    scores = model(req)
    codes = torch.stack([encode_scene(parse_prompt(p)) for p in prompts])
    with torch.no_grad():
        expected = torch.sigmoid(net(u8.float() / 255, codes)[:, 0])
    torch.testing.assert_close(scores, expected)
    assert scores.dtype == torch.float32 and ((scores > 0) & (scores < 1)).all()
    count_model = ShapesRewardModel(path, head="count")
    with torch.no_grad():
        torch.testing.assert_close(count_model(req), torch.sigmoid(net(u8.float() / 255, codes)[:, 3]))


def test_gradient_reaches_the_images_and_not_the_frozen_net(saved):
    _, path = saved
    model = ShapesRewardModel(path)
    images = torch.rand(3, 3, 32, 32, requires_grad=True)
    model.score_differentiable(
        images, ["a red circle", "two blue squares", "a green triangle"], []
    ).sum().backward()
    assert images.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in model.net.parameters())


def test_prompt_conditioning_changes_the_prediction(saved):
    _, path = saved
    model = ShapesRewardModel(path)
    image = torch.rand(1, 3, 32, 32).expand(2, -1, -1, -1)
    with torch.no_grad():
        a, b = model.score_differentiable(image, ["a red circle", "three blue squares"])
    assert a != b


def test_errors_name_the_problem(saved, tmp_path):
    _, path = saved
    with pytest.raises(ValueError, match="python -m unirl.train_reward_model"):
        ShapesRewardModel(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match=r"head must be one of \['strict', 'color'"):
        ShapesRewardModel(path, head="vibes")
    model = ShapesRewardModel(path)
    req = RewardRequest(
        sample_ids=["s0"], prompts=["a purple circle"], images=torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    )
    with pytest.raises(ValueError, match="sample 's0'.*a purple circle"):
        model(req)
    with pytest.raises(ValueError, match=r"RewardNet needs \[B, 3, 32, 32\] images, got \[1, 3, 16, 16\]"):
        model.score_differentiable(torch.zeros(1, 3, 16, 16), ["a red circle"])


# ---- training data -----------------------------------------------------------------------------


def test_blur_and_perturb_keep_the_image_format_and_are_seeded():
    flat = np.full((32, 32, 3), 77, dtype=np.uint8)
    assert np.array_equal(blur(flat), flat)
    ds = ShapesDataset("train")
    imgs, _ = ds.sample_batch(2, np.random.default_rng(1))
    a = perturb(imgs[0], np.random.default_rng(5), imgs[1])
    b = perturb(imgs[0], np.random.default_rng(5), imgs[1])
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3) and np.array_equal(a, b)


def test_near_misses_change_one_attribute_and_stay_in_training():
    ds = ShapesDataset("train")
    train = {e.prompt for e in ds.examples}
    rng = np.random.default_rng(0)
    seen = 0
    for spec in ds.scenes:
        cand = near_miss(spec, rng, train)
        if cand is None:
            continue
        seen += 1
        assert scene_to_prompt(cand) in train and cand.category == spec.category
        diffs = sum(a != b for a, b in zip(cand.objects, spec.objects, strict=True))
        diffs += (cand.count != spec.count) + (cand.relation != spec.relation)
        swapped = len(spec.objects) == 2 and cand.objects == spec.objects[::-1]
        assert diffs == 1 or (swapped and cand.relation == spec.relation), (spec, cand)
    assert seen > 0.9 * len(ds.scenes)


def test_synthetic_pairs_use_training_prompts_and_scorer_labels():
    images, prompts = synth_batch(64, np.random.default_rng(3))
    train = {e.prompt for e in ShapesDataset("train").examples}
    assert images.shape == (64, 32, 32, 3) and images.dtype == np.uint8 and set(prompts) <= train
    targets, mask = label(images, prompts)
    for i, r in enumerate(GenEvalMini().score_all(images, prompts)):
        for j, head in enumerate(HEADS):
            assert mask[i, j] == float(head in r)
            if head in r:
                assert targets[i, j] == float(r[head])
    assert 0.1 < targets[:, 0].mean() < 0.9  # both verdicts are represented


# ---- the committed model -----------------------------------------------------------------------

PINNED = {  # accuracy vs GenEvalMini on the committed held-out base samples (TRAINING.md)
    "heldout_train": {
        "strict": 0.7930,
        "color": 0.9648,
        "shape": 0.8203,
        "count": 0.7846,
        "position": 0.5942,
    },
    "heldout_eval": {"strict": 0.5539, "color": 0.8922, "shape": 0.6078, "count": 0.9167, "position": 0.4514},
}


def heldout_agreement(name: str) -> dict[str, float]:
    """Accuracy (threshold 0.5) of each verdict where it applies, recomputed from the images."""
    with np.load(os.path.join(COMMITTED, "heldout.npz")) as z:
        images, prompts = z[f"{name}_images"], [str(p) for p in z[f"{name}_prompts"]]
    targets, mask = label(images, prompts)
    model = ShapesRewardModel(COMMITTED)
    with torch.no_grad():
        probs = torch.sigmoid(
            model.logits(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, prompts)
        )
    out = {}
    for j, head in enumerate(HEADS):
        m = mask[:, j] > 0
        out[head] = float(((probs[m, j].numpy() > 0.5) == (targets[m, j] > 0.5)).mean())
    return out


@pytest.mark.parametrize("name", sorted(PINNED))
def test_committed_reward_model_agrees_with_the_scorer_on_held_out_base_samples(name):
    got = heldout_agreement(name)
    for head, value in PINNED[name].items():
        assert got[head] == pytest.approx(value, abs=0.005), (head, got)
