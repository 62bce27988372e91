"""Reward request and response: the contract between tracks and scorers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class RewardRequest:
    """Images, videos (with their soundtracks) or texts to score, one per sample.

    Exactly one of `images` and `texts` is set; `audio` comes beside videos (an audio-video
    family: LTX-2).

    Attributes:
        sample_ids: per sample, used to name failures.
        prompts: per sample.
        images: [B, 3, H, W] uint8 RGB images, or [B, F, 3, H, W] uint8 RGB videos of F frames (a
            video stage; `is_video`), or None for a text request.
        metadata: per-sample dicts from the data source (empty, or one per sample).
        texts: per-sample decoded responses of a text stage, or None for an image request.
        response_lengths: per-sample response length in tokens (text requests
            only, optional; length-based scorers need it).
        group_ids: per-sample group (the prompt a sample was drawn for), or empty; a group scorer
            (one with `groupwise = True`, scoring each sample against its siblings) reads the
            groups through `groups()`.
        audio: [B, A, T] fp32 waveforms of A channels in about [-1, 1], one per video, or None.
        audio_rate: their sample rate in Hz (0 without audio).
    """

    sample_ids: list[str]
    prompts: list[str]
    images: torch.Tensor | None = None
    metadata: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] | None = None
    response_lengths: list[int] | None = None
    group_ids: list[str] = field(default_factory=list)
    audio: torch.Tensor | None = None
    audio_rate: int = 0

    def __post_init__(self) -> None:
        batch = len(self.sample_ids)
        self._check_audio(batch)
        if self.group_ids and len(self.group_ids) != batch:
            raise ValueError(f"RewardRequest has {batch} sample_ids but {len(self.group_ids)} group_ids")
        if len(self.prompts) != batch:
            raise ValueError(f"RewardRequest has {batch} sample_ids but {len(self.prompts)} prompts")
        if self.metadata and len(self.metadata) != batch:
            raise ValueError(f"RewardRequest has {batch} sample_ids but {len(self.metadata)} metadata dicts")
        if (self.images is None) == (self.texts is None):
            got = "both" if self.images is not None else "neither"
            raise ValueError(f"RewardRequest needs exactly one of images and texts, got {got}")
        if self.images is not None:
            if (
                self.images.dtype != torch.uint8
                or self.images.dim() not in (4, 5)
                or self.images.shape[-3] != 3
            ):
                raise ValueError(
                    f"RewardRequest.images must be uint8 [B, 3, H, W] (or videos [B, F, 3, H, W]), got "
                    f"{self.images.dtype} {list(self.images.shape)}"
                )
            if self.images.shape[0] != batch:
                raise ValueError(f"RewardRequest has {batch} sample_ids but {self.images.shape[0]} images")
            if self.response_lengths is not None:
                raise ValueError(
                    "RewardRequest.response_lengths belongs to text requests, got it with images"
                )
            return
        if len(self.texts) != batch or not all(isinstance(t, str) for t in self.texts):
            raise ValueError(
                f"RewardRequest.texts must be {batch} strings (one per sample_id), got "
                f"{len(self.texts)} of types {sorted({type(t).__name__ for t in self.texts})}"
            )
        if self.response_lengths is not None:
            lengths = list(self.response_lengths)
            if len(lengths) != batch:
                raise ValueError(f"RewardRequest has {batch} texts but {len(lengths)} response_lengths")
            for sid, n in zip(self.sample_ids, lengths, strict=True):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(
                        f"RewardRequest.response_lengths for sample {sid!r} must be an int >= 0, got {n!r}"
                    )
            self.response_lengths = lengths

    def _check_audio(self, batch: int) -> None:
        if self.audio is None:
            if self.audio_rate:
                raise ValueError(f"RewardRequest.audio_rate={self.audio_rate} without audio")
            return
        if self.images is None:
            raise ValueError("RewardRequest.audio comes beside images or videos (an audio-video track), got texts")
        if not self.audio.is_floating_point() or self.audio.dim() != 3 or self.audio.shape[0] != batch:
            raise ValueError(
                f"RewardRequest.audio must be float [B={batch}, channels, samples], got {self.audio.dtype} "
                f"{list(self.audio.shape)}"
            )
        if isinstance(self.audio_rate, bool) or not isinstance(self.audio_rate, int) or self.audio_rate < 1:
            raise ValueError(f"RewardRequest.audio_rate must be the waveforms' sample rate in Hz (>= 1), got {self.audio_rate!r}")

    def __len__(self) -> int:
        return len(self.sample_ids)

    def groups(self, scorer: str) -> list[list[int]]:
        """The sample indices of each group, in order; a ValueError naming `scorer` when the
        request carries no group ids or a group's samples are not contiguous (a group split
        across requests, or interleaved with another)."""
        if not self.group_ids:
            raise ValueError(
                f"{scorer} scores each sample against its group, but the request carries no group ids: "
                "score whole groups through the reward service (RewardService sets them)"
            )
        runs: list[list[int]] = []
        seen: set[str] = set()
        for i, gid in enumerate(self.group_ids):
            if runs and self.group_ids[runs[-1][0]] == gid:
                runs[-1].append(i)
                continue
            if gid in seen:
                raise ValueError(
                    f"{scorer}: the samples of group {gid!r} are not contiguous in the request (sample "
                    f"{self.sample_ids[i]!r}); a group scorer needs each group whole and in one piece"
                )
            seen.add(gid)
            runs.append([i])
        return runs

    @property
    def is_video(self) -> bool:
        """Whether the request carries videos ([B, F, 3, H, W] frames)."""
        return self.images is not None and self.images.dim() == 5

    def require_images(self, scorer: str) -> torch.Tensor:
        """`images` [B, 3, H, W], or a ValueError saying that `scorer` needs images and got text or
        videos."""
        if self.images is None:
            raise ValueError(
                f"{scorer} needs images, but the request carries text: use a text scorer for a text stage"
            )
        if self.is_video:
            raise ValueError(
                f"{scorer} scores images, but the request carries videos {list(self.images.shape)}: wrap it "
                "in unirl.reward.local.video.FrameMean (the per-frame score averaged over frames)"
            )
        return self.images

    def require_videos(self, scorer: str) -> torch.Tensor:
        """`images` as videos [B, F, 3, H, W], or a ValueError saying that `scorer` needs videos."""
        if not self.is_video:
            got = "text" if self.images is None else f"images {list(self.images.shape)}"
            raise ValueError(f"{scorer} needs videos [B, F, 3, H, W], but the request carries {got}")
        return self.images

    def require_audio(self, scorer: str) -> tuple[torch.Tensor, int]:
        """(`audio` [B, A, T] fp32, `audio_rate`), or a ValueError saying that `scorer` needs the
        soundtracks of an audio-video track."""
        if self.audio is None:
            got = "text" if self.images is None else f"{'videos' if self.is_video else 'images'} without audio"
            raise ValueError(
                f"{scorer} scores audio, but the request carries {got}: score the track of an audio-video family "
                "(unirl.models.ltx2)"
            )
        return self.audio, self.audio_rate

    def require_texts(self, scorer: str) -> list[str]:
        """`texts`, or a ValueError saying that `scorer` needs text and got images."""
        if self.texts is None:
            raise ValueError(
                f"{scorer} needs text, but the request carries images: use an image scorer for an image stage"
            )
        return self.texts

    def require_response_lengths(self, scorer: str) -> list[int]:
        """`response_lengths`, or a ValueError saying that `scorer` needs them."""
        texts = self.require_texts(scorer)
        if self.response_lengths is None:
            raise ValueError(
                f"{scorer} needs response_lengths (tokens per response) and the request has none for "
                f"{len(texts)} texts: score a track whose segment is a TokenSegment"
            )
        return self.response_lengths


@dataclass
class RewardResponse:
    """Scores per component, each [B] fp32 (NaN marks a failed sample)."""

    components: dict[str, torch.Tensor]


@runtime_checkable
class DifferentiableReward(Protocol):
    """A reward whose score is differentiable in the image: what the reward-backprop losses
    (DRaFT, AlignProp, ReFL) differentiate through the sampler.

    `score_differentiable(images, prompts, metadata) -> [B]` fp32 scores, with
    `images` [B, 3, H, W] float RGB in [0, 1] (the stage's `decode_float`, with its
    autograd graph), `prompts` B strings and `metadata` B dicts (or empty). The
    scores keep the graph back to `images`; a component that is also a scorer
    scores `round(255 * images)` the same way up to that rounding.
    """

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor: ...
