"""Images a prompt row carries (a vision-language prompt's images, an edit's condition image),
read into PIL for any family: files, arrays or PIL images, a bad one named with its sample; and a
supervised row's demonstration as pixels (an image, or a video family's clip)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def load_image(entry: Any, sample_id: str, index: int) -> Any:
    """A PIL RGB image from a prompt row's `images[index]`: a file path, an HWC uint8
    array (numpy or torch, 3 channels, or 2-D gray) or a PIL image. Anything
    unreadable (missing or corrupt file, wrong mode or dtype, zero size) is an error
    naming the sample, the entry and the file."""
    from PIL import Image, UnidentifiedImageError

    where = f"sample {sample_id!r}: images[{index}]"
    if isinstance(entry, str):
        try:
            with Image.open(entry) as im:
                im.load()
                image = im.convert("RGB")
        except FileNotFoundError:
            raise ValueError(f"{where}: no image file {entry!r}") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{where}: cannot read image file {entry!r} ({e})") from None
    elif isinstance(entry, Image.Image):
        if entry.mode not in ("RGB", "RGBA", "L"):
            raise ValueError(f"{where}: PIL image mode {entry.mode!r}; give RGB, RGBA or L")
        image = entry.convert("RGB")
    elif isinstance(entry, (np.ndarray, torch.Tensor)):
        arr = entry.numpy() if isinstance(entry, torch.Tensor) else entry
        if arr.dtype != np.uint8:
            raise ValueError(f"{where}: image arrays must be uint8 (0..255), got {arr.dtype}")
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=-1)
        if arr.ndim != 3 or arr.shape[-1] != 3:
            raise ValueError(f"{where}: image arrays must be [H, W, 3] (or [H, W]), got {list(arr.shape)}")
        image = Image.fromarray(np.ascontiguousarray(arr), "RGB")
    else:
        raise ValueError(
            f"{where}: an image is a file path, an [H, W, 3] uint8 array or a PIL image, got {type(entry).__name__}"
        )
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where}: the image has zero size ({image.width} x {image.height})")
    return image


def row_images(
    examples: list, key: str, where: str, problems: list[str], noun: str, need: str, one: bool
) -> list[tuple[Any, list]]:
    """The images of every prompt row of `where` under metadata `key`, read for a family's
    `condition_problems`: [(row, its PIL images)] for the rows that read. A row with none (or,
    with `one`, not exactly one) adds "<where>: prompt <id> carries <n | no> <noun> in metadata
    <key>; <need>: give the row ..." to `problems`; an image that does not read adds
    `load_image`'s error. `noun` and `need` word it for the family ("first frame(s)", "Wan I2V
    animates exactly one")."""
    rows = []
    for ex in examples:
        entries = ex.metadata.get(key)
        if not isinstance(entries, list | tuple) or not entries or (one and len(entries) != 1):
            given = '["<image file>"]' if one else '["<image file>", ...]'
            problems.append(
                f"{where}: prompt {ex.prompt_id!r} carries {len(entries) if entries else 'no'} {noun} in "
                f'metadata {key!r}; {need}: give the row "{key}": {given}'
            )
            continue
        try:
            rows.append((ex, [load_image(entry, ex.prompt_id, i) for i, entry in enumerate(entries)]))
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    return rows


def demonstration_pixels(entry: Any, sample_id: str) -> torch.Tensor:
    """A supervised row's demonstration as fp32 pixels in [-1, 1]: an image (`load_image`'s
    entries) as [3, H, W], or a clip, a uint8 [F, H, W, 3] array, as [3, F, H, W]. A clip that is
    not uint8 or not [F, H, W, 3] is an error naming the sample."""
    if isinstance(entry, (np.ndarray, torch.Tensor)) and entry.ndim == 4:
        arr = entry.numpy() if isinstance(entry, torch.Tensor) else entry
        if arr.dtype != np.uint8 or arr.shape[-1] != 3:
            raise ValueError(
                f"sample {sample_id!r}: a demonstration clip is a uint8 [F, H, W, 3] array, got "
                f"{arr.dtype} {list(arr.shape)}"
            )
    else:
        arr = np.array(load_image(entry, sample_id, 0))
    return torch.from_numpy(np.ascontiguousarray(arr)).float().movedim(-1, 0) / 127.5 - 1.0


def one_metadata_image(metadata: dict, key: str, sample_id: str, need: str) -> Any:
    """The PIL image of a sample's `metadata[key]`, a list of exactly one: otherwise "sample <id>:
    <need> (metadata <key>: a list of one image), got <none | n>"; an image that does not read is
    `load_image`'s error."""
    entries = metadata.get(key)
    if not isinstance(entries, list | tuple) or len(entries) != 1:
        got = "none" if not entries else f"{len(entries)}"
        raise ValueError(f"sample {sample_id!r}: {need} (metadata {key!r}: a list of one image), got {got}")
    return load_image(entries[0], sample_id, 0)


def metadata_images(metadata: dict, key: str, sample_id: str, need: str) -> list:
    """The PIL images of a sample's `metadata[key]` (one or more); none is "sample <id>: <need>
    (metadata <key>: a list of images), got none"; an image that does not read is `load_image`'s
    error."""
    entries = metadata.get(key)
    if not isinstance(entries, list | tuple) or not entries:
        raise ValueError(f"sample {sample_id!r}: {need} (metadata {key!r}: a list of images), got none")
    return [load_image(entry, sample_id, i) for i, entry in enumerate(entries)]
