"""What supervised training shares with the rest once its loop is gone: the sigma draws of
flow-matching SFT (`unirl.sde.schedules.sample_sigmas`), the tiny whole-word tokenizers, and
`BundleEvaluator` (what `unirl.evaluate` scores a diffusion checkpoint with)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.sft import FlowSFTConfig
from unirl.models.flow.loading import tiny_clip_t5_tokenizers
from unirl.sde.schedules import sample_sigmas
from unirl.trainer.evaluation import BundleEvaluator, EvalSampling
from unirl.types import DiffusionSamplingParams
from worlds.shapes import GenEvalMini, ShapesDataset

WORDS = ["a", "red", "circle", "circles", "three", "triangles", "left", "of", "and", "above"]


@pytest.mark.parametrize("mode", ["logit_normal", "uniform"])
def test_sigmas_lie_in_open_unit_interval_and_shift(mode):
    s = sample_sigmas(4000, FlowSFTConfig(sigma_sampling=mode), torch.Generator().manual_seed(0))
    assert s.min() > 0 and s.max() < 1 and abs(float(s.mean()) - 0.5) < 0.03
    shifted = sample_sigmas(
        4000, FlowSFTConfig(sigma_sampling=mode, shift=3.0), torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(shifted, 3 * s / (1 + 2 * s))  # the same draws: sigma = 3t / (1 + 2t)


def test_whole_word_tokenizers():
    clip, t5 = tiny_clip_t5_tokenizers(12, 77, WORDS)
    text = "a red circle left of three triangles"
    assert clip.convert_ids_to_tokens(clip(text)["input_ids"])[1:-1] == [w + "</w>" for w in text.split()]
    assert t5.convert_ids_to_tokens(t5(text)["input_ids"])[:-1] == ["\u2581" + w for w in text.split()]
    assert len(clip("purple")["input_ids"]) > 3  # an unknown word still tokenizes, by characters


def test_evaluation_is_deterministic():
    bundle = tiny_model_config(words=WORDS).build()
    sampling = DiffusionSamplingParams(
        height=16, width=16, max_sequence_length=8, eta=0.0, guidance_scale=1.0
    )
    evaluator = BundleEvaluator(
        ShapesDataset("eval"),
        sampling,
        GenEvalMini(mode="strict"),
        EvalSampling(num_steps=2, samples_per_prompt=1),
    )
    a, b = evaluator(bundle), evaluator(bundle)
    assert a == b and "accuracy_strict" in a and 0.0 <= a["dense"] <= 1.0
