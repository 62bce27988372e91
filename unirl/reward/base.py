"""Reward backends: turn a `RewardRequest` into unweighted per-component scores.

A backend owns the scorers and the weight of each component; it does not
combine them. `RewardService` validates the scores, applies the weights and
attaches the result to a track.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from unirl.types.reward import DifferentiableReward, RewardRequest, RewardResponse

Scorer = Callable[[RewardRequest], torch.Tensor]
"""A weight-free scorer: `scorer(req) -> [B]` float tensor, one score per sample (NaN marks a failure)."""


class RewardBackend(ABC):
    """Scores images or texts per component.

    Contract:
        `score(req)` returns a `RewardResponse` whose `components` holds, for
        every name in `weights`, a [B] fp32 tensor of unweighted scores in
        request order. A failed sample is NaN; it is not dropped.
        `weights` maps each component name to the weight the service applies
        to it when summing the total reward.
    """

    @property
    @abstractmethod
    def weights(self) -> dict[str, float]:
        """Component name -> weight of that component in the total reward."""

    @abstractmethod
    def score(self, req: RewardRequest) -> RewardResponse:
        """Unweighted [B] fp32 scores of `req`'s samples, one tensor per component."""


class LocalRewardBackend(RewardBackend):
    """Runs weight-free scorers in-process.

    Args:
        components: component name -> scorer (`scorer(req) -> [B]` float
            tensor). Must not be empty.
        weights: component name -> weight; components not listed weigh 1.0.
            A key naming no component is an error.

    `score` calls every scorer in order and returns all components as [B]
    fp32 CPU tensors. Non-finite scores pass through unchanged (the service
    decides what to do with them). A scorer that raises propagates its
    exception with the component name prefixed to the message; a scorer
    whose output is not a [B] tensor raises ValueError naming the component.
    """

    def __init__(self, components: Mapping[str, Scorer], weights: Mapping[str, float] | None = None) -> None:
        if not components:
            raise ValueError("LocalRewardBackend needs at least one component, got none")
        for name, scorer in components.items():
            if not callable(scorer):
                raise ValueError(f"reward component {name!r} is not callable: got {type(scorer).__name__}")
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(components))
        if unknown:
            raise ValueError(
                f"reward weights name unknown component(s) {unknown}; known components: {sorted(components)}"
            )
        self.components: dict[str, Scorer] = dict(components)
        self._weights: dict[str, float] = {name: float(weights.get(name, 1.0)) for name in self.components}

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def score(self, req: RewardRequest) -> RewardResponse:
        batch = len(req)
        scores: dict[str, torch.Tensor] = {}
        for name, scorer in self.components.items():
            try:
                out = scorer(req)
            except Exception as e:
                # Keep the exception type so callers can still catch it; only the message gains the name.
                e.args = (f"reward component {name!r} failed: {e.args[0] if e.args else ''}", *e.args[1:])
                raise
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch,):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"reward component {name!r} must return a [B={batch}] tensor, got {got}")
            scores[name] = out.detach().to(device="cpu", dtype=torch.float32)
        return RewardResponse(components=scores)

    def differentiable_weights(self) -> dict[str, float]:
        """Name -> weight of the components a differentiable score sums: those of non-zero
        weight. Raises ValueError naming a weighted component without `score_differentiable`,
        or when every weight is zero."""
        out = {}
        for name, scorer in self.components.items():
            weight = self._weights[name]
            if weight == 0.0:
                continue
            if not isinstance(scorer, DifferentiableReward):
                raise ValueError(
                    f"reward component {name!r} ({type(scorer).__name__}) has weight {weight} but is not "
                    "differentiable (no score_differentiable): a reward-backprop algorithm needs every "
                    "weighted component differentiable; give it weight 0 or use a differentiable scorer"
                )
            out[name] = weight
        if not out:
            raise ValueError(
                f"no reward component has a non-zero weight (weights: {self._weights}): nothing to differentiate"
            )
        return out

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """[B] fp32 `sum_c weight_c * component_c.score_differentiable(images, prompts, metadata)`
        over `differentiable_weights()` (zero-weight monitors, such as a strict scorer logged
        beside the reward, are skipped), with the autograd graph back to `images` ([B, 3, H, W]
        float in [0, 1]; see `unirl.types.reward.DifferentiableReward`)."""
        total = None
        for name, weight in self.differentiable_weights().items():
            out = self.components[name].score_differentiable(images, prompts, metadata)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (images.shape[0],):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"reward component {name!r} must return a [B={images.shape[0]}] tensor, got {got}"
                )
            out = weight * out.to(torch.float32)
            total = out if total is None else total + out
        return total
