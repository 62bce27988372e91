"""`JointTrainStack`: the two segments of one backbone in one optimizer step. Its gradient is
w_plan grad L_plan + w_image grad L_image, each L the segment's GRPO loss at the first update
(ratio 1: -A grad log p aggregated by the segment's own mode), written out here on the stages'
log-probs; a frozen segment adds nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.grpo import GRPO, GRPOConfig
from unirl.models.causal_lm import CausalLMStage
from unirl.models.image_tokens import VQImageStage
from unirl.models.janus import JanusModelConfig
from unirl.rollout.unified import UnifiedEngine
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.joint import JointTrainStack
from unirl.train.stack import TrainStackConfig
from unirl.types import (
    AdvantageConfig,
    ImageTokenSamplingParams,
    PromptExample,
    RolloutReq,
    TextSamplingParams,
)

MODES = {"plan": "token-mean", "image": "seq-mean-token-mean"}


@pytest.fixture(scope="module")
def bundle():
    return JanusModelConfig(tiny={"max_position_embeddings": 128, "seed": 1}).build()


def setup(bundle, max_new_tokens: int = 6):
    stages = {"plan": CausalLMStage(bundle), "image": VQImageStage(bundle)}
    plan_sampling = TextSamplingParams(
        samples_per_prompt=4,
        max_new_tokens=max_new_tokens,
        stop_tokens=["<end_of_plan>"],
        chat_template=False,
    )
    engine = UnifiedEngine(["plan", "image"]).bind(
        stages, {"plan": plan_sampling, "image": ImageTokenSamplingParams(guidance_scale=2.0)}
    )
    req = RolloutReq.from_prompts(
        [PromptExample("a red circle", "p0"), PromptExample("blue", "p1")], plan_sampling, None, rollout_id=0
    )
    return stages, engine.generate(req)


def expected_loss(stage, track, mode: str) -> torch.Tensor:
    """GRPO's loss at ratio 1 written out: -A log p per token, aggregated by `mode`."""
    logp = stage.token_log_probs(track.segment)
    mask = track.segment.response_mask()
    per_token = -track.advantages[:, None] * logp * mask
    if mode == "token-mean":
        return per_token.sum() / mask.sum()
    return (per_token.sum(1) / mask.sum(1)).mean()


@pytest.fixture(scope="module")
def rollout(bundle):
    return setup(bundle)


@pytest.mark.parametrize("trained", [("plan", "image"), ("image",), ("plan",)])
def test_joint_gradient_is_the_weighted_sum_and_frozen_adds_nothing(bundle, rollout, trained):
    stages, resp = rollout[0], copy.deepcopy(rollout[1])
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.3, 0.8, 0.2, 0.6, 0.5])
    for track in resp.tracks.values():
        track.rewards = rewards.clone()  # the image's reward credited to its plan
        track_advantages(track, AdvantageConfig())
    weights = {"plan": 0.5, "image": 2.0}
    expected = {}
    model = bundle.model
    model.zero_grad(set_to_none=True)
    total = sum(weights[n] * expected_loss(stages[n], resp.tracks[n], MODES[n]) for n in trained)
    total.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    backend = TrainBackend(model, None, OptimConfig(max_grad_norm=1e9), total_steps=1)
    for s in stages.values():
        s.module = backend.module
    algorithms = {n: GRPO(GRPOConfig(loss_agg_mode=MODES[n])) for n in trained}
    stack = JointTrainStack(stages, backend, algorithms, weights, TrainStackConfig(micro_batch_size=4))
    seen = {}

    def capture():
        seen.update({n: p.grad.clone() for n, p in backend.named_params if p.grad is not None})
        backend.zero_grad()
        return {"train/grad_norm": 0.0, "train/lr": 0.0, "train/skipped_step": 0.0}

    backend.optimizer_step = capture
    metrics = stack.train_tracks({n: resp.tracks[n] for n in trained}, 0.0)
    assert seen.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(seen[name], grad, atol=1e-6, rtol=1e-4)
    text_head, image_head = "lm_head.weight", "model.generation_head.vision_head.weight"
    assert (text_head in seen) == ("plan" in trained) and (image_head in seen) == ("image" in trained)
    for n in trained:
        assert metrics[f"{n}/ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-5)


def test_weights_and_mini_batches_are_checked(bundle):
    stages = {"plan": CausalLMStage(bundle)}
    backend = TrainBackend(bundle.model, None, OptimConfig(), total_steps=1)
    with pytest.raises(ValueError, match="trained segments need a weight > 0"):
        JointTrainStack(stages, backend, {"plan": GRPO()}, {"plan": 0.0}, TrainStackConfig())
    with pytest.raises(ValueError, match="num_mini_batches=2"):
        JointTrainStack(
            stages, backend, {"plan": GRPO()}, {"plan": 1.0}, TrainStackConfig(num_mini_batches=2)
        )
    # what no loss reaches stays frozen: the optimizer holds no state for it
    frozen = TrainBackend(bundle.model, None, OptimConfig(), total_steps=1, frozen=bundle.frozen_modules)
    names = [n for n, _ in frozen.named_params]
    assert names and not any(
        n.startswith(("model.vqmodel.", "model.vision_model.", "model.aligner.")) for n in names
    )
    assert any(n.startswith("model.generation_aligner.") for n in names)


def test_plans_over_budget_are_truncated_and_marked(bundle):
    """A plan that never emits its stop token within max_new_tokens is kept truncated and marked on
    both tracks; the image is still drawn after it, in the user prompt's group, linked to its plan."""
    _, resp = setup(bundle, max_new_tokens=2)
    plan, image = resp.tracks["plan"], resp.tracks["image"]
    assert all(len(r) == 2 for r in plan.segment.response_ids)
    assert all(m["plan_truncated"] for m in plan.metadata)
    assert all(
        m["plan_truncated"] and m["plan"] == t for m, t in zip(image.metadata, plan.texts, strict=True)
    )
    assert image.parent_ids == plan.sample_ids and image.group_ids == plan.group_ids == image.root_ids
    assert image.sample_ids == [f"{s}/0" for s in plan.sample_ids]


def test_drawing_without_a_plan_is_the_image_after_the_prompt_alone(bundle):
    """The evaluation's floor: `draw` gives the images the image stage draws after prompt + BOI
    (no plan), seeded from the image's id as a rollout's image is."""
    from unirl.types.lineage import child_seed

    stages = {"plan": CausalLMStage(bundle), "image": VQImageStage(bundle)}
    sampling = ImageTokenSamplingParams(guidance_scale=2.0, seed=7)
    engine = UnifiedEngine(["plan", "image"]).bind(
        stages, {"plan": TextSamplingParams(chat_template=False), "image": sampling}
    )
    req = RolloutReq.from_prompts(
        [PromptExample("a red circle", "p0"), PromptExample("blue", "p1")],
        TextSamplingParams(samples_per_prompt=2, chat_template=False),
        None,
        rollout_id=3,
    )
    images = engine.draw(req)
    tok = bundle.tokenizer
    contexts = [torch.tensor(tok.encode(p) + [bundle.boi_token_id]) for p in req.prompts]
    seeds = [child_seed(7, 3, f"{sid}/0") for sid in req.sample_ids]
    _, expected = stages["image"].generate(contexts, seeds, sampling)
    assert torch.equal(images, expected)
