"""Preference pairs from a JSON-lines file: the offline data of Diffusion-DPO.

One pair per line (blank lines are skipped):

    {"prompt": "a red circle", "chosen": "img/0_w.png", "rejected": "img/0_l.png"}

`chosen` (preferred) and `rejected` are paths relative to the file's directory (or
absolute), each an RGB image (`.png`, `.jpg`, `.jpeg`; the model sees it in [-1, 1],
[3, H, W]) or a latent (`.pt`: a float tensor [C, h, w] saved with `torch.save`, for a
model with a VAE). Every sample of the file must have one shape. Any problem is a
ValueError naming the file and line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
LATENT_SUFFIXES = (".pt",)


@dataclass
class PreferencePair:
    """A prompt and two samples of it, `chosen` preferred to `rejected` (fp32 [C, H, W])."""

    prompt: str
    chosen: torch.Tensor
    rejected: torch.Tensor


def _load_sample(path: str, where: str) -> torch.Tensor:
    suffix = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise ValueError(f"{where}: {path} does not exist")
    if suffix in IMAGE_SUFFIXES:
        from PIL import Image

        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.float32)
        return torch.from_numpy(rgb).permute(2, 0, 1) / 127.5 - 1.0
    if suffix in LATENT_SUFFIXES:
        t = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_floating_point()):
            raise ValueError(f"{where}: {path} must hold a float tensor [C, h, w], got {_describe(t)}")
        return t.float()
    raise ValueError(
        f"{where}: {path} has an unsupported suffix; use an image ({', '.join(IMAGE_SUFFIXES)}) or a "
        f"latent ({', '.join(LATENT_SUFFIXES)})"
    )


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {list(t.shape)}"
    return type(t).__name__


def load_preference_pairs(path: str) -> list[PreferencePair]:
    """All pairs of the JSON-lines file `path` (see the module docstring for the schema)."""
    if not os.path.isfile(path):
        raise ValueError(f"preference pairs file {path} does not exist")
    root = os.path.dirname(os.path.abspath(path))
    pairs: list[PreferencePair] = []
    shape: tuple[tuple[int, ...], str] | None = None
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected an object with prompt, chosen, rejected")
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
            if missing:
                raise ValueError(f"{where}: missing {missing}; each line needs prompt, chosen and rejected")
            for key in ("prompt", "chosen", "rejected"):
                if not isinstance(row[key], str) or not row[key]:
                    raise ValueError(f"{where}: {key} must be a non-empty string, got {row[key]!r}")
            samples = []
            for key in ("chosen", "rejected"):
                sample = _load_sample(os.path.join(root, row[key]), f"{where} ({key})")
                if shape is None:
                    shape = (tuple(sample.shape), f"{where} ({key})")
                elif tuple(sample.shape) != shape[0]:
                    raise ValueError(
                        f"{where} ({key}): shape {list(sample.shape)} differs from {list(shape[0])} at {shape[1]}; "
                        "every sample of the file must have one shape"
                    )
                samples.append(sample)
            pairs.append(PreferencePair(row["prompt"], *samples))
    if not pairs:
        raise ValueError(f"preference pairs file {path} holds no pairs")
    return pairs


class PreferencePairsFile:
    """Offline preference data: `sample_batch(n, rng) -> (prompts, chosen [n, C, H, W], rejected)`,
    pairs drawn uniformly with replacement from the file's (`load_preference_pairs`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pairs = load_preference_pairs(path)

    def __len__(self) -> int:
        return len(self.pairs)

    def sample_batch(self, n: int, rng: np.random.Generator) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        idx = rng.integers(0, len(self.pairs), size=n)
        picked = [self.pairs[i] for i in idx]
        return (
            [p.prompt for p in picked],
            torch.stack([p.chosen for p in picked]),
            torch.stack([p.rejected for p in picked]),
        )
