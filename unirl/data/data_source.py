"""Prompt data sources: epoch-based, resumable batches of `PromptExample`.

`ListDataSource` holds the batching logic once; `PromptDataSource` (a prompt
file), `DefaultDataSource` (built-in smoke prompts) and `SampledDemonstrations` (a world's drawn
images or clips, a supervised track's rows) only supply the list.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np

from unirl.data.datasets import load_prompts
from unirl.types.rollout_req import PromptExample

DEFAULT_PROMPTS = (
    "a red circle",
    "a blue square on a white background",
    "a green triangle",
    "a yellow star on a black background",
    "two red apples on a table",
    "a white cat sitting on a chair",
    "a black dog on green grass",
    "a small house with a red roof",
    "a sunset over the ocean",
    "a purple flower in a glass vase",
    "an orange ball on the sand",
    "a snowy mountain under a blue sky",
    "a cup of coffee on a wooden table",
    "a yellow banana on a plate",
    "a tree with green leaves",
    "a bicycle leaning against a wall",
)


class ListDataSource:
    """Batches over a fixed list of prompts, epoch by epoch.

    Each epoch visits the prompts in a fresh order: a permutation from
    `random.Random(seed * 1_000_003 + epoch)` when `shuffle` (so seed s, epoch e+1 never
    repeats seed s+1, epoch e), file order otherwise. A batch
    never spans two epochs: when fewer than `n` prompts remain, they are dropped
    and the next epoch starts. The position is `(epoch, position)`, saved by
    `state_dict` so a resumed run draws the identical sequence of batches.

    Args:
        examples: the prompts; must be non-empty.
        shuffle: permute each epoch.
        seed: base seed of the per-epoch permutation.
        source: a human-readable name of where the prompts came from, used in errors.
    """

    def __init__(
        self, examples: list[PromptExample], shuffle: bool = True, seed: int = 0, source: str = "<list>"
    ):
        if not examples:
            raise ValueError(f"{source}: data source has no prompts")
        self.examples = list(examples)
        self.shuffle = shuffle
        self.seed = seed
        self.source = source
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None  # this epoch's permutation, drawn at its first batch

    def __len__(self) -> int:
        return len(self.examples)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptExample]:
        """Return the next `n` prompts (copies; mutating them does not affect the source).

        Raises:
            ValueError: `n < 1`, or `n` exceeds the number of prompts (a batch
                never spans epochs, so it could never be filled).
        """
        if n < 1:
            raise ValueError(f"prompts_per_rollout must be >= 1, got {n}")
        if n > len(self.examples):
            raise ValueError(
                f"prompts_per_rollout={n} exceeds the {len(self.examples)} prompts in {self.source}; "
                "lower prompts_per_rollout or add prompts"
            )
        if self.position + n > len(self.examples):
            self._start_epoch(self.epoch + 1)
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.position : self.position + n]
        self.position += n
        return [dataclasses.replace(self.examples[i], metadata=dict(self.examples[i].metadata)) for i in idx]

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._order = None

    def state_dict(self) -> dict[str, Any]:
        """Position plus what it depends on: `{epoch, position, seed, shuffle, num_prompts}`."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position.

        Raises:
            ValueError: the state was saved with a different seed, shuffle or
                number of prompts, so resuming would not reproduce the sequence.
        """
        current = {"seed": self.seed, "shuffle": self.shuffle, "num_prompts": len(self.examples)}
        mismatched = {k: (state[k], v) for k, v in current.items() if k in state and state[k] != v}
        if mismatched:
            detail = ", ".join(
                f"{k}: saved {saved!r} vs now {now!r}" for k, (saved, now) in mismatched.items()
            )
            raise ValueError(
                f"{self.source}: data source state does not match ({detail}); "
                "resume with the same data file, seed and shuffle setting"
            )
        if not 0 <= state["position"] <= len(self.examples):
            raise ValueError(
                f"{self.source}: saved position {state['position']} is outside [0, {len(self.examples)}]"
            )
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])


class PromptDataSource(ListDataSource):
    """Prompts loaded from a file at construction (see `load_prompts` for formats); `path_keys`:
    the metadata keys whose file lists resolve against the file's directory (`images`, and an
    edit model's `condition_key` when it is another).

    Raises:
        PromptFileError: the file is missing or malformed.
    """

    def __init__(
        self,
        data_path: str,
        shuffle: bool = True,
        seed: int = 0,
        prompt_key: str = "prompt",
        path_keys: list[str] | None = None,
    ):
        self.data_path = data_path
        keys = ("images",) if path_keys is None else tuple(path_keys)
        super().__init__(
            load_prompts(data_path, prompt_key=prompt_key, path_keys=keys),
            shuffle=shuffle,
            seed=seed,
            source=data_path,
        )


class DefaultDataSource(ListDataSource):
    """The 16 built-in `DEFAULT_PROMPTS` (ids `default:{i}`), for smoke runs without a data file."""

    def __init__(self, seed: int = 0, shuffle: bool = True):
        examples = [PromptExample(prompt=p, prompt_id=f"default:{i}") for i, p in enumerate(DEFAULT_PROMPTS)]
        super().__init__(examples, shuffle=shuffle, seed=seed, source="<built-in DEFAULT_PROMPTS>")


class SampledDemonstrations(ListDataSource):
    """`rows` demonstrations drawn once from a world's sampler, as the rows of a supervised track
    (`unirl.rollout.demonstrations.DemonstrationEngine` with `target_key: key`).

    Args:
        sampler: an object with `sample_batch(n, rng) -> (media, prompts)`: uint8 images
            [n, H, W, 3], or clips [n, F, H, W, 3] for a video family, and their n prompts (the
            OCR world's `OCRWords`, the moving squares' `MovingSquares`).
        rows: how many to draw (>= 1), with `numpy.random.default_rng(seed)`, in one call.
        seed: the draw's seed and the epochs' shuffle seed.
        key: the metadata key of a row's demonstration.
        name: the rows' `prompt_id` prefix (`<name>/<i>`).

    Row i is prompt i with `{key: media[i]}`; the rows are fixed, and each epoch visits them in a
    fresh order (`ListDataSource`).
    """

    def __init__(
        self,
        sampler: Any,
        rows: int,
        seed: int = 0,
        key: str = "image",
        name: str = "demo",
        shuffle: bool = True,
    ) -> None:
        if rows < 1:
            raise ValueError(f"SampledDemonstrations rows must be >= 1, got {rows}")
        if not callable(getattr(sampler, "sample_batch", None)):
            raise TypeError(
                f"SampledDemonstrations sampler {type(sampler).__name__} has no sample_batch(n, rng) -> (media, prompts)"
            )
        media, prompts = sampler.sample_batch(rows, np.random.default_rng(seed))
        examples = [
            PromptExample(prompt=p, prompt_id=f"{name}/{i}", metadata={key: media[i]})
            for i, p in enumerate(prompts)
        ]
        super().__init__(
            examples,
            shuffle=shuffle,
            seed=seed,
            source=f"<{rows} demonstrations of {type(sampler).__name__} seed={seed}>",
        )
