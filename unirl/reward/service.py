"""`RewardService`: score a track, validate the scores, attach weighted rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unirl.reward.base import RewardBackend
from unirl.types.reward import RewardRequest
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


class RewardError(RuntimeError):
    """A backend returned scores the step cannot train on (missing, misshapen or non-finite)."""


class RewardService:
    """Scores tracks with a `RewardBackend` and attaches the rewards.

    Args:
        backend: produces the unweighted components and their weights.
    """

    def __init__(self, backend: RewardBackend) -> None:
        self.backend = backend

    def score_and_attach(self, track: RolloutTrack) -> dict[str, float]:
        """Score `track.media` or `track.texts`; set `track.rewards` and `track.reward_components`.

        The response must hold exactly the components named in
        `backend.weights`, each [B] and finite; anything else raises
        `RewardError` and leaves the track untouched (the step stops rather
        than train on a bad reward). The total reward is
        sum_c weight_c * component_c in fp32.

        Returns:
            `reward/mean`, `reward/std` (population) of the total, and
            `reward/<name>/mean`, `reward/<name>/std` per unweighted component.
        """
        req = self._request(track)
        returned = self.backend.score(req).components
        weights = self.backend.weights
        batch = len(track)

        for name in weights:
            if name not in returned:
                raise RewardError(
                    f"reward backend returned no component {name!r} for track {track.name!r}; "
                    f"returned: {sorted(returned)}"
                )
        extra = sorted(set(returned) - set(weights))
        if extra:
            raise RewardError(
                f"reward backend returned component(s) {extra} that have no weight; "
                f"weighted components: {sorted(weights)}"
            )

        components: dict[str, torch.Tensor] = {}
        for name in weights:
            scores = returned[name]
            if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (batch,):
                got = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise RewardError(f"reward component {name!r} must be [B={batch}], got {got}")
            scores = scores.detach().to(torch.float32)
            bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
            if bad:
                i = bad[0]
                others = [track.sample_ids[j] for j in bad[1:6]]
                more = f"; also sample(s) {others}{' ...' if len(bad) > 6 else ''}" if others else ""
                raise RewardError(
                    f"reward component {name!r} is {scores[i].item()} for sample {track.sample_ids[i]!r} "
                    f"(track {track.name!r}, {len(bad)} non-finite value(s) in this component{more}); "
                    "the step is stopped: fix the scorer or the sample"
                )
            components[name] = scores

        total = torch.zeros(batch, dtype=torch.float32, device=next(iter(components.values())).device)
        for name, weight in weights.items():
            total += weight * components[name]

        track.rewards = total
        track.reward_components = components
        track.reward_weights = dict(weights)
        return self.metrics(track)

    @staticmethod
    def metrics(track: RolloutTrack) -> dict[str, float]:
        """`reward/mean`, `reward/std` (population) of a scored track's total reward and
        `reward/<name>/mean`, `reward/<name>/std` per component (what `score_and_attach`
        returns; a rollout scored chunk by chunk reports its whole batch with this)."""
        total = track.rewards
        metrics = {"reward/mean": total.mean().item(), "reward/std": total.std(unbiased=False).item()}
        for name, scores in track.reward_components.items():
            metrics[f"reward/{name}/mean"] = scores.mean().item()
            metrics[f"reward/{name}/std"] = scores.std(unbiased=False).item()
        return metrics

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """[B] the weighted total reward of `images` ([B, 3, H, W] float in [0, 1]) with its
        autograd graph: the same weights as `score_and_attach`, zero-weight components
        skipped (`LocalRewardBackend.score_differentiable`). So a recipe's `reward` serves the
        reward-backprop algorithms too (`algorithm.reward: ${reward}`): the loss differentiates
        the reward the run logs. A backend that scores elsewhere cannot; it raises ValueError."""
        self.check_differentiable()
        return self.backend.score_differentiable(images, prompts, metadata)

    def check_differentiable(self) -> None:
        """Raise ValueError unless `score_differentiable` can work: a local backend whose weighted
        components are all differentiable (reward-backprop algorithms call it when built, so a
        recipe fails before Ray starts)."""
        weights = getattr(self.backend, "differentiable_weights", None)
        if weights is None:
            raise ValueError(
                f"reward backend {type(self.backend).__name__} cannot differentiate its scores: use "
                "unirl.reward.LocalRewardBackend with differentiable components for a reward-backprop algorithm"
            )
        weights()

    @staticmethod
    def _request(track: RolloutTrack) -> RewardRequest:
        """The request for `track`: its images, or its texts with the segment's response lengths."""
        if len(track) == 0:
            raise ValueError(f"track {track.name!r} has no samples to score")
        common = {
            "sample_ids": list(track.sample_ids),
            "prompts": list(track.prompts),
            "metadata": list(track.metadata),
            "group_ids": list(track.group_ids),
        }
        if track.media is not None and track.texts is not None:
            raise ValueError(f"track {track.name!r} has both media and texts: a track scores one modality")
        try:
            if track.media is not None:
                return RewardRequest(images=track.media, audio=track.audio, audio_rate=track.audio_rate, **common)
            if track.texts is not None:
                lengths = track.segment.response_lengths if isinstance(track.segment, TokenSegment) else None
                return RewardRequest(
                    texts=list(track.texts),
                    response_lengths=None if lengths is None else [int(n) for n in lengths.tolist()],
                    **common,
                )
        except ValueError as e:
            raise ValueError(f"track {track.name!r} cannot be scored: {e}") from e
        raise ValueError(
            f"track {track.name!r} has no media and no texts to score: decode images (media) or "
            "responses (texts) before scoring"
        )
