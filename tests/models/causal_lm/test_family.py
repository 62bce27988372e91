"""The text family contract (`unirl.models.causal_lm.family`): the bundles the shared text stage
takes satisfy it, and a bundle that lacks a member is refused when the stage is built, named."""

from __future__ import annotations

import pytest

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig, TinyVLMConfig
from unirl.models.causal_lm.family import TextFamily, VisionTextFamily, text_family_problems
from unirl.models.janus import JanusModelConfig, TinyJanusConfig
from unirl.models.qwen import QwenConfig
from unirl.models.qwen_vl import QwenVLConfig


@pytest.fixture(scope="module")
def bundles() -> dict:
    return {
        "lm": QwenConfig(tiny=TinyLMConfig()).build(),
        "vlm": QwenVLConfig(tiny=TinyVLMConfig()).build(),
        "janus": JanusModelConfig(tiny=TinyJanusConfig()).build(),
    }


def test_every_text_bundle_is_a_text_family(bundles) -> None:
    for name, bundle in bundles.items():
        assert isinstance(bundle, TextFamily), name
        assert text_family_problems(bundle) == [], name
        # the stage builds on it, and masks exactly the family's vision tokens out of sampling
        assert CausalLMStage(bundle).unsampled_ids == list(bundle.vision_token_ids), name
    assert bundles["lm"].vision_token_ids == () and not bundles["lm"].has_vision
    assert bundles["vlm"].has_vision and isinstance(bundles["vlm"], VisionTextFamily)
    assert not bundles["janus"].has_vision and len(bundles["janus"].vision_token_ids) == 3


class NoTokenizer:
    has_vision = False
    vision_token_ids = ()

    def __init__(self, model) -> None:
        self.model = model


class VisionWithoutPrepare:
    has_vision = True
    vision_token_ids = (7,)

    def __init__(self, bundle) -> None:
        self.model, self.tokenizer = bundle.model, bundle.tokenizer

    @staticmethod
    def positions(input_ids, attention_mask, image_grid_thw):
        return None

    vision_inputs = 3  # not callable


def test_a_bundle_missing_a_member_is_refused_naming_it(bundles) -> None:
    lm = bundles["lm"]
    bad = NoTokenizer(lm.model)
    assert not isinstance(bad, TextFamily)
    assert text_family_problems(bad) == [
        "NoTokenizer lacks `tokenizer`, which the text stage calls (unirl.models.causal_lm.family.TextFamily)"
    ]
    with pytest.raises(TypeError, match="NoTokenizer lacks `tokenizer`"):
        CausalLMStage(bad)
    vision = VisionWithoutPrepare(lm)
    assert isinstance(vision, TextFamily)
    problems = text_family_problems(vision)
    assert [p.split("`")[1] for p in problems] == ["prepare", "vision_inputs"]
    assert all(p.endswith("family.VisionTextFamily)") for p in problems)
    with pytest.raises(TypeError, match="VisionWithoutPrepare lacks `prepare`.*lacks `vision_inputs`"):
        CausalLMStage(vision)
