"""The text-rendering world: short words drawn in black on white, read back by a real OCR model.

A word is 2 to 4 capital letters of `LETTERS`, drawn bold with Pillow's bundled font (no system
font needed, so every machine renders the same pixels) at `FONT_SIZE` px, one letter per `CELL`-px
slot, centred on a `HEIGHT` x `WIDTH` white canvas with a small random shift. Clean renders are read exactly by PP-OCRv4's
recogniser (`unirl.reward.local.OCRReward`, tested in `tests/ocr/`). The prompt names the word in
lower case between double quotes, `a sign that says "cat"`, as Flow-GRPO's OCR prompts do (the
OCR reward compares case-insensitively; the tiny model's tokenizers are lower-case): with no
merges for these words, its tokenizers spell a word character by character, so an unseen word is
encodable.

Splits (`split_words(seed)`), disjoint, fixed by the seed:
    train           every 2-letter word and `N_TRAIN_4` 4-letter words (what pretraining and RL see)
    heldout         `N_HELDOUT` 4-letter words outside train: held-out words of seen characters
    heldout_length  `N_HELDOUT` 3-letter words: a length pretraining never saw
    length_rl       the other 3-letter words (800): RL's prompts for teaching that length, never
                    evaluated (heldout_length stays unseen by pretraining and RL alike)
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from unirl.types import PromptExample

LETTERS = "ACEHKMNPRT"
"""The alphabet: ten capitals that the recogniser does not confuse with each other or digits."""
HEIGHT, WIDTH = 32, 64
FONT_SIZE = 18
CELL = 15
"""Each letter is centred in its own CELL-px slot; a word's slots are centred on the canvas, so a
letter's place depends only on its index and the word's length (a tiny model learns that far
faster than proportional spacing, where every letter moves with its neighbours' widths)."""
STROKE = 1
"""Pixels of outline drawn around each glyph in the same black: a bold face, which both a tiny
model and the recogniser see better at 32 px."""
MAX_SHIFT = (2, 1)
"""Largest random shift of a training render from the centre, (x, y) pixels."""
N_TRAIN_4 = 1500
N_HELDOUT = 200
SPLITS = ("train", "heldout", "heldout_length", "length_rl")
TEMPLATE = 'a sign that says "{}"'


@cache
def _font() -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=FONT_SIZE)


def render_word(word: str, shift: tuple[int, int] = (0, 0)) -> np.ndarray:
    """uint8 [HEIGHT, WIDTH, 3]: `word` in upper case, black on white, one letter per `CELL`-px
    slot, the slots centred and moved by `shift`; raises if the word does not fit whole."""
    text = word.upper()
    if len(text) * CELL > WIDTH - 2 * abs(shift[0]) or abs(shift[1]) > 4:
        raise ValueError(f"{text!r} moved by {shift} does not fit a {HEIGHT}x{WIDTH} canvas ({CELL} px a letter)")
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    x0 = (WIDTH - len(text) * CELL) / 2 + shift[0]
    for i, letter in enumerate(text):
        left, top, right, bottom = draw.textbbox((0, 0), letter, font=_font(), stroke_width=STROKE)
        x = x0 + i * CELL + (CELL - (right - left)) / 2 - left
        y = (HEIGHT - (bottom - top)) / 2 - top + shift[1]
        draw.text((x, y), letter, fill="black", font=_font(), stroke_width=STROKE, stroke_fill="black")
    return np.array(image)


def word_prompt(word: str) -> str:
    """The prompt asking for `word`: its lower-case spelling between double quotes."""
    return TEMPLATE.format(word.lower())


def split_words(seed: int = 0) -> dict[str, list[str]]:
    """{split: words} for `SPLITS`, upper case, each list sorted; disjoint; fixed by `seed`."""
    rng = np.random.default_rng(seed)
    fours = ["".join(p) for p in itertools.product(LETTERS, repeat=4)]
    picked = rng.choice(len(fours), size=N_TRAIN_4 + N_HELDOUT, replace=False)
    twos = ["".join(p) for p in itertools.product(LETTERS, repeat=2)]
    threes = ["".join(p) for p in itertools.product(LETTERS, repeat=3)]
    heldout_length = {threes[i] for i in rng.choice(len(threes), size=N_HELDOUT, replace=False)}
    return {
        "train": sorted(twos + [fours[i] for i in picked[:N_TRAIN_4]]),
        "heldout": sorted(fours[i] for i in picked[N_TRAIN_4:]),
        "heldout_length": sorted(heldout_length),
        "length_rl": sorted(set(threes) - heldout_length),
    }


class OCRWords:
    """The prompts of one split, and rendered image/prompt batches for supervised pretraining.

    Args:
        split: one of `SPLITS`.
        seed: the split seed.
        limit: keep the first `limit` words of a seeded shuffle of the split (None: all), for a
            short evaluation.

    Attributes:
        words: the split's words (upper case).
        examples: one `PromptExample(word_prompt(w), "ocr/<split>/<w>", {"text": w, "slice": split})`
            per word; `metadata["text"]` is the OCR target.
    """

    def __init__(self, split: str = "train", seed: int = 0, limit: int | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"OCRWords split must be one of {SPLITS}, got {split!r}")
        words = split_words(seed)[split]
        if limit is not None:
            if limit < 1:
                raise ValueError(f"OCRWords limit must be >= 1 or null, got {limit}")
            order = np.random.default_rng(seed + 1).permutation(len(words))
            words = [words[i] for i in order[:limit]]
        self.split, self.words = split, words
        self.examples = [
            PromptExample(
                prompt=word_prompt(w), prompt_id=f"ocr/{split}/{w}", metadata={"text": w, "slice": split}
            )
            for w in words
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def sample_batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
        """n random words of this split, each rendered with a random shift of at most `MAX_SHIFT`.

        Returns:
            images: uint8 [n, HEIGHT, WIDTH, 3]; prompts: n strings.
        """
        images = np.empty((n, HEIGHT, WIDTH, 3), dtype=np.uint8)
        prompts = []
        for i in range(n):
            word = self.words[int(rng.integers(len(self.words)))]
            shift = (
                int(rng.integers(-MAX_SHIFT[0], MAX_SHIFT[0] + 1)),
                int(rng.integers(-MAX_SHIFT[1], MAX_SHIFT[1] + 1)),
            )
            images[i] = render_word(word, shift)
            prompts.append(word_prompt(word))
        return images, prompts
