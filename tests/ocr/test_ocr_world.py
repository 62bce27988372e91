"""The OCR world (worlds/ocr): disjoint splits, prompts the OCR reward reads its target from, renders
PP-OCRv4 reads exactly, letter-by-letter tokenization of unseen words, and a tiny model that
trains and samples at the world's 32x64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.models.flow.loading import tiny_clip_t5_tokenizers
from unirl.reward.local.ocr import quoted_text
from unirl.train.sft import FlowMatchingSFT, FlowMatchingSFTConfig
from worlds.ocr import (
    HEIGHT,
    LETTERS,
    SPLITS,
    WIDTH,
    OCRAccuracy,
    OCRWords,
    render_word,
    split_words,
    word_prompt,
)


def test_splits_are_disjoint_sized_and_fixed_by_the_seed():
    splits = split_words(0)
    assert [len(splits[s]) for s in SPLITS] == [100 + 1500, 200, 200, 800]
    assert not set(splits["train"]) & set(splits["heldout"])
    assert not set(splits["heldout_length"]) & set(splits["length_rl"])  # RL never sees an evaluated word
    assert len(set(splits["heldout_length"]) | set(splits["length_rl"])) == len(LETTERS) ** 3
    assert {len(w) for w in splits["train"]} == {2, 4} and {len(w) for w in splits["heldout"]} == {4}
    assert {len(w) for w in splits["heldout_length"]} == {len(w) for w in splits["length_rl"]} == {3}
    assert all(set(w) <= set(LETTERS) for s in SPLITS for w in splits[s])
    assert split_words(0) == splits and split_words(1)["heldout"] != splits["heldout"]
    with pytest.raises(ValueError, match="does not fit a 32x64 canvas"):
        render_word("MMMMM")


def test_prompt_quotes_the_word_the_ocr_reward_reads():
    ds = OCRWords("heldout", limit=5)
    assert len(ds) == 5 and len({e.prompt for e in ds.examples}) == 5
    for e in ds.examples:
        assert quoted_text(e.prompt) == e.metadata["text"].lower() and e.metadata["slice"] == "heldout"
    assert word_prompt("CAT") == 'a sign that says "cat"'
    with pytest.raises(ValueError, match="split must be one of"):
        OCRWords("test")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        OCRWords("train", limit=0)


def test_an_unseen_word_is_spelled_letter_by_letter_by_the_tiny_tokenizers():
    clip, t5 = tiny_clip_t5_tokenizers(16, 16, ["a", "sign", "that", "says"])
    tokens = clip.convert_ids_to_tokens(clip(word_prompt("HMPT"))["input_ids"])
    assert tokens[1:5] == ["a</w>", "sign</w>", "that</w>", "says</w>"]
    assert tokens[6:10] == ["h", "m", "p", "t</w>"]
    assert [t for t in t5.convert_ids_to_tokens(t5(word_prompt("HMPT"))["input_ids"]) if t in "hmpt"] == list(
        "hmpt"
    )


def test_clean_renders_are_read_exactly_and_a_blank_scores_zero():
    words = ["AC", "HKMN", "PRT", "TEAM", "NECK"]
    images = torch.stack([torch.from_numpy(render_word(w, (2, -1))).permute(2, 0, 1) for w in words])
    left = render_word("AC", (-2, 0))
    assert np.array_equal(left[:, :-2], render_word("AC", (0, 0))[:, 2:])  # a shift moves the pixels whole
    prompts = [word_prompt(w) for w in words]
    assert OCRAccuracy().evaluate(images, prompts) == {"ocr": 1.0, "accuracy": 1.0}
    blank = torch.full((1, 3, HEIGHT, WIDTH), 255, dtype=torch.uint8)
    assert OCRAccuracy().evaluate(blank, prompts[:1]) == {"ocr": 0.0, "accuracy": 0.0}
    wrong = OCRAccuracy().scores(images[3:4], [word_prompt("TEAK")])  # reads TEAM: 1 edit of 4
    assert float(wrong[0]) == pytest.approx(0.75)


def test_training_batches_are_shifted_renders_of_the_split():
    ds = OCRWords("train")
    images, prompts = ds.sample_batch(8, np.random.default_rng(0))
    assert images.shape == (8, HEIGHT, WIDTH, 3) and images.dtype == np.uint8
    again, _ = ds.sample_batch(8, np.random.default_rng(0))
    assert np.array_equal(images, again)
    words = [quoted_text(p).upper() for p in prompts]
    assert set(words) <= set(ds.words)
    centred = [render_word(w) for w in words]
    assert any(not np.array_equal(a, b) for a, b in zip(images, centred, strict=True))  # shifted
    ink = [
        (255.0 - a.astype(float)).sum() / (255.0 - b.astype(float)).sum()
        for a, b in zip(images, centred, strict=True)
    ]
    assert all(abs(r - 1) < 0.03 for r in ink), ink  # nothing cut at the border


def test_a_tiny_model_of_resolution_64_trains_on_32x64_and_refuses_wider(tmp_path):
    bundle = tiny_model_config(resolution=64, words=["a", "sign", "that", "says"], clip_max_length=16).build()
    cfg = FlowMatchingSFTConfig(batch_size=2, max_sequence_length=16, warmup_steps=1, eval_every=0)
    sft = FlowMatchingSFT(bundle, OCRWords("train"), cfg, str(tmp_path))
    loss = sft.train_step()
    assert np.isfinite(loss["loss"])

    class Wide:
        def sample_batch(self, n, rng):
            return np.zeros((n, 32, 72, 3), np.uint8), ["x"] * n

    sft.data = Wide()
    with pytest.raises(ValueError, match=r"sides of at most 64 \(raise model.tiny.resolution"):
        sft.train_step()
