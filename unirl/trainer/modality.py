"""What the driver knows about a track's modality, so one driver loop serves images and text.

A modality answers three questions for the `Trainer`: how to turn a batch of
prompts into a `RolloutReq` (diffusion pins a sigma schedule for the model's
image geometry; text needs none), which fields of a rollout the driver fetches
to score it (images, or the decoded texts and the token segment), and how to
keep a step's samples for people to look at (an image grid, or a JSON list of
prompts and responses; both appear in the gallery). An image track's modality also tells the
evaluation (`unirl.trainer.evaluation.Evaluator`) its rollouts' sampling and the model's
`model_info` (the schedule's token count). The modality follows from the recipe's sampling params
(`modality_for`); the workers and the model family decide everything else.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

from unirl.sde.schedules import schedule_tokens, sigmas_for
from unirl.tracking.metrics import save_audio, save_image_grid
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams

# per-sample fields every modality's scoring fetches
BASE_FIELDS = ["sample_ids", "group_ids", "prompts", "metadata"]


class ImageModality:
    """Diffusion tracks: requests carry the sigma schedule of the model's latent grid.

    Args:
        sampling: the recipe's sampling params.
        model_info: the workers' `model_info()` (needs `vae_scale_factor`, `patch_size`).
    """

    name: ClassVar[str] = "diffusion"
    reward_fields: ClassVar[list[str]] = [*BASE_FIELDS, "media"]

    def __init__(self, sampling: DiffusionSamplingParams, model_info: dict[str, Any]) -> None:
        self.sampling = sampling
        self.model_info = model_info
        self.image_seq_len = schedule_tokens(sampling, model_info)
        self.sigmas = sigmas_for(sampling, self.image_seq_len)
        if model_info.get("audio_sample_rate"):  # an audio-video family: its tracks carry soundtracks
            self.reward_fields = [*self.reward_fields, "audio"]

    def request(self, examples: list[PromptExample], rollout_id: int) -> RolloutReq:
        return RolloutReq.from_prompts(examples, self.sampling, self.sigmas, rollout_id=rollout_id)

    def save_samples(self, track: RolloutTrack, path_stem: str) -> None:
        """`<stem>.png` (the grid), `<stem>.json` (prompts and rewards) and, for an audio-video
        track, each sample's soundtrack `<stem>_<i>.wav`."""
        save_image_grid(track.media, path_stem + ".png", track.prompts, track.rewards.tolist())
        if track.audio is not None:
            save_audio(track.audio, track.audio_rate, path_stem)


class TextModality:
    """Autoregressive tracks: requests carry only the prompts and the text sampling params."""

    name: ClassVar[str] = "text"
    reward_fields: ClassVar[list[str]] = [*BASE_FIELDS, "texts", "segment"]

    def __init__(self, sampling: TextSamplingParams, model_info: dict[str, Any]) -> None:
        self.sampling = sampling

    def request(self, examples: list[PromptExample], rollout_id: int) -> RolloutReq:
        return RolloutReq.from_prompts(examples, self.sampling, None, rollout_id=rollout_id)

    def save_samples(self, track: RolloutTrack, path_stem: str) -> None:
        """`<stem>.json`: per sample the prompt, the response, its reward and token count."""
        os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
        lengths = track.segment.response_lengths.tolist()
        rows = [
            {"prompt": p, "response": t, "reward": r, "response_tokens": n}
            for p, t, r, n in zip(track.prompts, track.texts, track.rewards.tolist(), lengths, strict=True)
        ]
        with open(path_stem + ".json", "w") as f:
            json.dump(rows, f, indent=1)


MODALITIES = {DiffusionSamplingParams: ImageModality, TextSamplingParams: TextModality}


def modality_for(sampling: Any, model_info: dict[str, Any]) -> ImageModality | TextModality:
    """The modality of a recipe's sampling params."""
    for kind, modality in MODALITIES.items():
        if isinstance(sampling, kind):
            return modality(sampling, model_info)
    raise TypeError(
        f"sampling is a {type(sampling).__name__}; a recipe's sampling must be one of "
        f"{[k.__name__ for k in MODALITIES]}"
    )
