"""The moving-squares world: a video analogue of the shapes world, where motion can be learned.

A clip is `num_frames` frames of `size` x `size` px on the shapes world's background: one red
square (the world's red) that moves `speed` px a frame to the left, to the right, or stays, each
direction equally likely, at a random height and a random start that keeps it whole in every
frame. The prompt names only the square's size ("a small red square"), never its direction, so a
model pretrained on these clips draws each direction about a third of the time: the temporal
reward `ColorMotion([1, 0, 0], right)` scores such a model's clips about +s, 0 or -s
(s = speed (num_frames - 1) / size, 0.5 at the defaults) and averages about 0, with the room to
rise to s that RL has to find. Pretraining recipe: `sft/squares_wan_pretrain`; RL recipe:
`diffusion/squares_wan_flowgrpo`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from unirl.types.rollout_req import PromptExample
from worlds.shapes.world import BACKGROUND, PALETTE

SQUARE_SIDES: dict[str, int] = {"tiny": 3, "small": 4, "medium": 5, "large": 6}
"""Side length in px of each prompt's square."""

DIRECTIONS: dict[str, int] = {"left": -1, "still": 0, "right": 1}
"""Sign of the horizontal step of each direction."""

WORDS: tuple[str, ...] = ("a", "red", "square", *SQUARE_SIDES)
"""Every word of the world's prompts (a tiny tokenizer's vocabulary)."""


def square_prompt(size_word: str) -> str:
    """'a <size> red square'."""
    return f"a {size_word} red square"


def render_clip(
    side: int, direction: str, x0: int, y: int, num_frames: int, size: int, speed: int
) -> np.ndarray:
    """uint8 [num_frames, size, size, 3]: the square of `side` px with its top-left corner at
    (x0 + t * speed * sign, y) in frame t."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {tuple(DIRECTIONS)}, got {direction!r}")
    clip = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    clip[:] = BACKGROUND
    step = speed * DIRECTIONS[direction]
    for t in range(num_frames):
        x = x0 + t * step
        if not (0 <= x and x + side <= size and 0 <= y and y + side <= size):
            raise ValueError(f"the square leaves the frame at t={t} (x={x}, y={y}, side={side}, size={size})")
        clip[t, y : y + side, x : x + side] = PALETTE["red"]
    return clip


class MovingSquares:
    """The world's prompts (a `ListDataSource`'s examples: `len`, `[i]`) and its clip/prompt
    batches for supervised pretraining (`sample_batch(n, rng) -> (uint8 clips [n, F, H, W, 3],
    prompts)`, the rows of `unirl.data.SampledDemonstrations`).

    Args:
        num_frames: frames per clip (>= 2).
        size: frame height and width in px.
        speed: px the square moves per frame (>= 1); the largest square must fit its whole path:
            max side + speed (num_frames - 1) <= size.
        directions: the directions `sample_batch` draws from, uniformly (default all three;
            `[right]` gives the clips a motion reward asks for, for supervised fine-tuning).
    """

    def __init__(
        self,
        num_frames: int = 5,
        size: int = 16,
        speed: int = 2,
        directions: Sequence[str] = tuple(DIRECTIONS),
    ) -> None:
        if num_frames < 2:
            raise ValueError(
                f"MovingSquares num_frames must be >= 2 (motion needs two frames), got {num_frames}"
            )
        if speed < 1:
            raise ValueError(f"MovingSquares speed must be >= 1 px a frame, got {speed}")
        travel = speed * (num_frames - 1)
        if max(SQUARE_SIDES.values()) + travel > size:
            raise ValueError(
                f"MovingSquares: a {max(SQUARE_SIDES.values())} px square moving {travel} px does not fit "
                f"{size} px frames; lower speed or num_frames, or raise size"
            )
        directions = list(directions)
        if not directions or any(d not in DIRECTIONS for d in directions):
            raise ValueError(
                f"MovingSquares directions must be a non-empty list of {list(DIRECTIONS)}, got {directions!r}"
            )
        self.num_frames, self.size, self.speed, self.directions = num_frames, size, speed, directions
        self.examples: list[PromptExample] = [
            PromptExample(prompt=square_prompt(w), prompt_id=f"squares/{w}") for w in SQUARE_SIDES
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def sample_batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
        """n random clips: a size word, a direction (of `directions`) and a placement drawn uniformly each.

        Returns:
            videos: uint8 [n, num_frames, size, size, 3]; prompts: n strings.
        """
        words, directions = list(SQUARE_SIDES), self.directions
        travel = self.speed * (self.num_frames - 1)
        videos = np.empty((n, self.num_frames, self.size, self.size, 3), dtype=np.uint8)
        prompts = []
        for i in range(n):
            word = words[int(rng.integers(len(words)))]
            direction = directions[int(rng.integers(len(directions)))]
            side = SQUARE_SIDES[word]
            span = self.size - side - (0 if direction == "still" else travel)
            x = int(rng.integers(span + 1))
            if direction == "left":
                x += travel
            y = int(rng.integers(self.size - side + 1))
            videos[i] = render_clip(side, direction, x, y, self.num_frames, self.size, self.speed)
            prompts.append(square_prompt(word))
        return videos, prompts
