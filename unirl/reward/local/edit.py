"""How much of an edit's source image the result keeps: the "rest of the scene kept" half of an
edit reward, which needs the source a prompt row carries (`metadata["images"]`, the image an edit
family such as FLUX.1-Kontext conditioned on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from unirl.models.images import load_image
from unirl.types.reward import RewardRequest


class SourcePreservation:
    """Scorer: 1 - mean over pixels and channels of |image / 255 - source / 255|, the source being
    the sample's `metadata[key][index]` (a file, array or PIL image) resized bilinearly to the
    image's size. Weight-free and dense; in [0, 1], 1 when the result is the source. Paired with a
    reward for the asked change (e.g. `ColorTarget` for "make it red"), it scores an edit that
    changes what was asked and keeps the rest.

    Args:
        key: the metadata key of the sample's condition images.
        index: which of them is the source.

    Sources are read once per path and kept (a prompt file has few).
    """

    def __init__(self, key: str = "images", index: int = 0) -> None:
        if index < 0:
            raise ValueError(f"SourcePreservation index must be >= 0, got {index}")
        self.key = key
        self.index = index
        self._sources: dict[tuple[str, int, int], torch.Tensor] = {}

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against their sources."""
        images = req.require_images("SourcePreservation").to(torch.float32) / 255.0
        return self.score_differentiable(images, req.prompts, req.metadata, req.sample_ids)

    def score_differentiable(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict[str, Any]],
        sample_ids: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """[B] scores of float images [B, 3, H, W] in [0, 1], with the graph (a
        `DifferentiableReward`); a sample without a source is an error naming it."""
        if len(metadata) != len(images):
            raise ValueError(
                f"SourcePreservation scores an image against its source (metadata {self.key!r}); got "
                f"{len(images)} images and {len(metadata)} metadata dicts"
            )
        _, _, height, width = images.shape
        ids = list(sample_ids) if sample_ids else [str(i) for i in range(len(images))]
        sources = torch.stack(
            [self._source(meta, sid, height, width) for meta, sid in zip(metadata, ids, strict=True)]
        ).to(device=images.device, dtype=images.dtype)
        return 1.0 - (images - sources).abs().mean(dim=(1, 2, 3))

    def _source(self, meta: dict[str, Any], sample_id: str, height: int, width: int) -> torch.Tensor:
        entries = meta.get(self.key)
        if not isinstance(entries, list | tuple) or len(entries) <= self.index:
            raise ValueError(
                f"sample {sample_id!r}: SourcePreservation needs its source image in metadata "
                f"{self.key!r}[{self.index}], got {entries!r}"
            )
        entry = entries[self.index]
        cache = (entry, height, width) if isinstance(entry, str) else None
        if cache is not None and cache in self._sources:
            return self._sources[cache]
        image = load_image(entry, sample_id, self.index)
        if image.size != (width, height):
            image = image.resize((width, height), Image.BILINEAR)
        source = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        if cache is not None:
            self._sources[cache] = source
        return source
