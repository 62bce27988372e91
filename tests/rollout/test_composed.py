"""`ComposedEngine` on the committed shapes models: rewrites the image model's whole-word tokenizer
cannot read (empty, non-words, past its token budget) render and score as samples, never a crash."""

from __future__ import annotations

import os

import torch

from tests.conftest import REPO
from unirl.models.causal_lm import CausalLMStage
from unirl.models.qwen import QwenConfig
from unirl.models.sd3 import SD3ModelConfig, SD3Stage
from unirl.rollout.composed import ComposedEngine
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq, TextSamplingParams
from unirl.types.reward import RewardRequest
from worlds.shapes import GenEvalMini

REWRITES = [
    "",  # the PE stopped at once
    "zzqx vorp blim",  # no word the image model knows
    "a crimson orb beneath a scarlet delta " + "and more filler words " * 6,  # unknown words, over budget
    "a red circle",  # the canonical prompt
]


def test_unreadable_rewrites_are_low_reward_samples_not_crashes() -> None:
    text = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=8, max_prompt_length=64, chat_template=False
    )
    image = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=2, height=32, width=32, eta=0.0, max_sequence_length=12, seed=3
    )
    pe = QwenConfig(pretrained_path=os.path.join(REPO, "checkpoints", "shapes_pe")).build()
    sd3 = SD3ModelConfig(pretrained_path=os.path.join(REPO, "checkpoints", "shapes_sd3")).build()
    engine = ComposedEngine(["ar", "diffusion"]).bind(
        {"ar": CausalLMStage(bundle=pe), "diffusion": SD3Stage(bundle=sd3)}, {"ar": text, "diffusion": image}
    )
    examples = [
        PromptExample(f"a user prompt {i}.", f"u{i}", {"canonical": "a red circle"}) for i in range(4)
    ]
    req = RolloutReq.from_prompts(examples, text, None, rollout_id=0)
    with torch.no_grad():
        resp = engine.generate(req, texts_override={"ar": REWRITES})
    images = resp.track("diffusion")
    assert images.prompts == [r for r in REWRITES for _ in range(2)]
    assert images.parent_ids == [p for p in req.sample_ids for _ in range(2)]
    pixels = images.media
    assert pixels.shape == (8, 3, 32, 32) and pixels.dtype == torch.uint8
    scores = GenEvalMini(mode="dense", intent_key="canonical")(
        RewardRequest(
            sample_ids=images.sample_ids, prompts=images.prompts, images=pixels, metadata=images.metadata
        )
    )
    assert torch.isfinite(scores).all() and ((scores >= 0) & (scores <= 1)).all()
