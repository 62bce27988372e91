"""Metric sinks: one JSON object per step in `metrics.jsonl` (and its reader), and sample image grids."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch
from PIL import Image


class JsonlWriter:
    """Appends one JSON object per `write` to `path` (flushed each line).

    Non-finite floats are written as null so every line stays valid JSON.
    """

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._f = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_rows(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a `metrics.jsonl` at `path`, and one problem per line that is not a JSON
    object, naming the file and the 1-based line (`<path>:<line>: ...`); those lines are skipped,
    so a half-written last line or a corrupted one costs only itself. A missing file raises
    `FileNotFoundError`."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(
                    f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); line skipped"
                )
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                problems.append(f"{path}:{lineno}: a {type(row).__name__}, not a JSON object; line skipped")
    return rows, problems


def save_image_grid(
    images: torch.Tensor, path: str, captions: list[str], rewards: list[float], ncols: int | None = None
) -> None:
    """Save [B, 3, H, W] uint8 images as one PNG grid at `path`, and their
    prompts and rewards beside it as `<path stem>.json`.

    Videos [B, F, 3, H, W] are saved as frame strips: one row per video, its F frames left to
    right (a tile of H x F*W), and each caption entry carries `"frames": F` (the gallery reads
    the grid as one column of strips)."""
    frames = None
    if images.dim() == 5:
        b, frames, c, h, w = images.shape
        images = images.permute(0, 2, 3, 1, 4).reshape(b, c, h, frames * w)
        ncols = 1
    b, _, h, w = images.shape
    ncols = ncols or min(b, 8)
    nrows = math.ceil(b / ncols)
    grid = np.zeros((nrows * h, ncols * w, 3), dtype=np.uint8)
    arr = images.permute(0, 2, 3, 1).numpy()
    for i in range(b):
        r, c = divmod(i, ncols)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = arr[i]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    Image.fromarray(grid).save(path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        extra = {} if frames is None else {"frames": frames}
        rows = [{"prompt": p, "reward": r, **extra} for p, r in zip(captions, rewards, strict=True)]
        json.dump(rows, f, indent=1)


def save_audio(audio: torch.Tensor, rate: int, path_stem: str) -> list[str]:
    """Save soundtracks [B, A, T] (about [-1, 1], clipped there) at `rate` Hz as 16-bit PCM WAV
    files `<stem>_<i>.wav`, one per sample; returns their paths."""
    import wave

    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    pcm = (audio.detach().float().clamp(-1, 1) * 32767).round().to(torch.int16).cpu().numpy()
    paths = []
    for i, clip in enumerate(pcm):
        path = f"{path_stem}_{i}.wav"
        with wave.open(path, "wb") as f:
            f.setnchannels(clip.shape[0])
            f.setsampwidth(2)
            f.setframerate(rate)
            f.writeframes(np.ascontiguousarray(clip.T).tobytes())
        paths.append(path)
    return paths
