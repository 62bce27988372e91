"""`unirl.trainer.modality`: what the one driver loop does differently for images and text."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from unirl.dataplane import get_batch, make_transport, put_batch
from unirl.sde.schedules import sigmas_for
from unirl.trainer.modality import ImageModality, TextModality, modality_for
from unirl.types import (
    DiffusionSamplingParams,
    PromptExample,
    RolloutTrack,
    TextSamplingParams,
    TokenSegment,
)

EXAMPLES = [PromptExample("two cats", "a"), PromptExample("one dog", "b")]


def text_track() -> RolloutTrack:
    lengths = [1, 3, 2, 4]
    return RolloutTrack(
        name="text",
        sample_ids=[f"s{i}" for i in range(4)],
        group_ids=["g0", "g0", "g1", "g1"],
        prompts=["p0", "p0", "p1", "p1"],
        metadata=[{"answer": str(i)} for i in range(4)],
        segment=TokenSegment(
            prompt_ids=[torch.arange(3 + i) for i in range(4)],
            response_ids=[torch.arange(n) + 7 for n in lengths],
            log_probs=[-torch.rand(n) for n in lengths],
            temperature=0.8,
        ),
        texts=["a", "bcd", "ef", "ghij"],
        rewards=torch.tensor([0.0, 1.0, 0.5, 0.25]),
    )


def test_image_requests_pin_the_schedule_of_the_model_grid():
    sp = DiffusionSamplingParams(num_steps=6, samples_per_prompt=2, height=32, width=32)
    mod = modality_for(sp, {"vae_scale_factor": 1, "patch_size": 4})
    assert isinstance(mod, ImageModality) and mod.image_seq_len == 64
    req = mod.request(EXAMPLES, rollout_id=3)
    assert torch.equal(req.sigmas, sigmas_for(sp, 64)) and len(req) == 4 and req.rollout_id == 3
    assert "media" in mod.reward_fields


def test_text_requests_carry_no_schedule():
    sp = TextSamplingParams(samples_per_prompt=3)
    mod = modality_for(sp, {})
    req = mod.request(EXAMPLES, rollout_id=5)
    assert isinstance(mod, TextModality) and req.sigmas is None and req.sde_indices == []
    assert req.group_ids[:3] == [req.group_ids[0]] * 3 and len(req) == 6
    with pytest.raises(ValueError, match="sigmas must be None for text sampling"):
        type(req).from_prompts(EXAMPLES, sp, torch.zeros(3), 0)
    with pytest.raises(TypeError, match="sampling must be one of"):
        modality_for(object(), {})


def test_text_scoring_fetch_rebuilds_the_whole_token_segment():
    """The driver asks for `segment`: every `segment.*` field comes back (jagged), media stays None."""
    track = text_track()
    transport = make_transport({"name": "inband"})
    meta = put_batch(transport, "step_0", track)
    got = get_batch(transport, meta, TextModality.reward_fields)
    assert got.texts == track.texts and got.media is None and got.rewards is None
    for name in ("prompt_ids", "response_ids", "log_probs"):
        want = getattr(track.segment, name)
        assert [t.tolist() for t in getattr(got.segment, name)] == [t.tolist() for t in want], name
    assert got.segment.temperature == 0.8 and got.segment.ref_log_probs is None


def test_text_samples_are_kept_as_json(tmp_path):
    track = text_track()
    TextModality(TextSamplingParams(), {}).save_samples(track, str(tmp_path / "samples" / "step_0001"))
    rows = json.loads((tmp_path / "samples" / "step_0001.json").read_text())
    assert [r["response"] for r in rows] == track.texts
    assert [r["response_tokens"] for r in rows] == [1, 3, 2, 4] and rows[1]["reward"] == 1.0


def test_evaluation_runs_at_its_own_size():
    """Decoupled resolution: rollouts at 16x16, evaluation at 32x32 (`eval.sampling.height/width`),
    through the real tiny SD3 stage: the images the scorer gets are 32x32, the evaluation schedule
    is pinned for 32x32's token count, and the rollout request keeps 16x16."""
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.models.sd3 import SD3ModelConfig
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.trainer.evaluation import EvalSampling, Evaluator

    bundle = SD3ModelConfig(
        tiny={"resolution": 32, "pixel_space": True, "patch_size": 4, "num_layers": 1, "clip_max_length": 8}
    ).build()
    stage = FlowMatchingStage(bundle)
    sp = DiffusionSamplingParams(num_steps=2, height=16, width=16, shift=3.0, max_sequence_length=8)
    mod = modality_for(sp, stage.model_info())
    assert mod.request(EXAMPLES, 0).sampling.height == 16
    seen = {}

    def sample(req):
        seen["sigmas"], seen["size"] = req.sigmas, (req.sampling.height, req.sampling.width)
        return TrainsideEngine(stage, 8).generate(req).track("diffusion").media

    class Shapes:
        def evaluate(self, images, prompts):
            seen["images"] = tuple(images.shape)
            return {"n": float(len(prompts))}

    evaluator = Evaluator(EXAMPLES, Shapes(), EvalSampling(num_steps=2, height=32, width=32))
    assert evaluator.run(sample, mod) == {"n": 2.0}
    assert seen["images"] == (2, 3, 32, 32) and seen["size"] == (32, 32)
    assert torch.equal(seen["sigmas"], sigmas_for(replace(sp, height=32, width=32, eta=0.0), 64))
    Evaluator(EXAMPLES, Shapes(), EvalSampling(num_steps=2)).run(sample, mod)  # null: the rollouts' size
    assert seen["images"] == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="eval.sampling.height must be >= 1"):
        EvalSampling(height=0)


def test_reward_scorer_means_per_source():
    from unirl.reward.local.color import ColorTarget
    from unirl.trainer.evaluation import RewardScorer

    examples = [PromptExample("a", "0", {"source": "x"}), PromptExample("b", "1", {"source": "y"})]
    scorer = RewardScorer({"red": ColorTarget([1.0, 0.0, 0.0])}, examples)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 2, 2), generator=g, dtype=torch.uint8)
    out = scorer.evaluate(images, ["a", "b", "a", "b"])
    hand = 1 - (images.float() / 255 - torch.tensor([1.0, 0, 0]).view(1, 3, 1, 1)).abs().mean(dim=(1, 2, 3))
    assert out["red"] == pytest.approx(float(hand.mean()))
    assert out["red/x"] == pytest.approx(float(hand[[0, 2]].mean()))
    assert out["red/y"] == pytest.approx(float(hand[[1, 3]].mean()))
