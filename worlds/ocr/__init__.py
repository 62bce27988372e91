"""The text-rendering world: short words drawn by a tiny text-to-image model, scored by PP-OCRv4
(`unirl.reward.local.OCRReward`). See README.md."""

from worlds.ocr.scorer import OCRAccuracy
from worlds.ocr.world import (
    FONT_SIZE,
    HEIGHT,
    LETTERS,
    SPLITS,
    WIDTH,
    OCRWords,
    render_word,
    split_words,
    word_prompt,
)

__all__ = [
    "OCRAccuracy",
    "FONT_SIZE",
    "HEIGHT",
    "LETTERS",
    "SPLITS",
    "WIDTH",
    "OCRWords",
    "render_word",
    "split_words",
    "word_prompt",
]
