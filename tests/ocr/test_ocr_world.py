"""The OCR world (worlds/ocr): disjoint splits, prompts the OCR reward reads its target from, renders
PP-OCRv4 reads exactly, letter-by-letter tokenization of unseen words, and a tiny model that
trains at the world's 32x64 as a supervised track (`diffusion/ocr_sft`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.recipes import IN_PROCESS, recipe, run
from unirl.config.validate import ConfigError
from unirl.models.flow.loading import tiny_clip_t5_tokenizers
from unirl.reward.local.ocr import quoted_text
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
    """`diffusion/ocr_sft` (the world's renders as a supervised track's demonstrations) trains the
    tiny SD3 of resolution 64 on 32x64 images; a width past its position embedding is refused
    before the run, naming the key."""
    small = ["num_steps=2", "prompts_per_rollout=2", "train.stack.micro_batch_size=2", "data_source.rows=8"]
    small += [
        "eval.every_n_steps=0",
        "checkpoint.every_n_steps=0",
        "threads_per_worker=1",
        "model.tiny.num_layers=1",
    ]
    rows = run("diffusion/ocr_sft", tmp_path / "a", *IN_PROCESS, *small)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(
        np.isfinite(r["loss"]) for r in rows if "loss" in r
    )
    with pytest.raises(ConfigError, match=r"sampling.width=128"):
        recipe("diffusion/ocr_sft", tmp_path / "b", *small, "sampling.width=128")
