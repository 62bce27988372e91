"""The PE world's text reward: does a rewrite state the user's scene in the canonical grammar?

Two prompts state the same scene when their `SceneSpec`s are equal after `normalize_scene`:
two_objects in either order, and a position scene either way round ("a blue square right of a
red circle" is "a red circle left of a blue square"). A count-1 counting prompt ("one red
circle") is not a single one ("a red circle"): the diffusion base only knows the latter.
"""

from __future__ import annotations

import torch

from unirl.types.reward import RewardRequest
from worlds.shapes.paraphrase import INVERSE_RELATION
from worlds.shapes.world import COLORS, SHAPES, SceneSpec, ShapeSpec, parse_prompt


def _order(obj: ShapeSpec) -> tuple[int, int]:
    return COLORS.index(obj.color), SHAPES.index(obj.shape)


def normalize_scene(spec: SceneSpec) -> SceneSpec:
    """The scene with its two objects in (colour, shape) index order; a position scene so
    reordered takes the inverse relation. Single and counting scenes come back unchanged."""
    if len(spec.objects) != 2 or _order(spec.objects[0]) <= _order(spec.objects[1]):
        return spec
    a, b = spec.objects
    relation = None if spec.relation is None else INVERSE_RELATION[spec.relation]
    return SceneSpec(spec.category, [b, a], spec.count, relation)


def same_scene(a: SceneSpec, b: SceneSpec) -> bool:
    """Whether two scene specs ask for the same image (see the module docstring)."""
    return normalize_scene(a) == normalize_scene(b)


class RewriteMatchesScene:
    """Scorer: 1.0 when a response, stripped, parses (`parse_prompt`) to the scene of
    `metadata[canonical_key]` (`same_scene`: either order of two objects, the swapped form of a
    relation), else 0.0; an unparsable response scores 0.

    A sample without the key, or whose reference does not parse, is a data bug and raises
    ValueError naming the sample id.

    Args:
        canonical_key: metadata key holding the canonical prompt of the user's scene.
    """

    def __init__(self, canonical_key: str = "canonical") -> None:
        if not isinstance(canonical_key, str) or not canonical_key:
            raise ValueError(
                "RewriteMatchesScene: reward.backend.components.<name>.canonical_key must be a non-empty "
                f"string, got {canonical_key!r}"
            )
        self.canonical_key = canonical_key

    def reference(self, sample_id: str, metadata: dict) -> SceneSpec:
        """The scene a sample asks for."""
        if self.canonical_key not in metadata:
            raise ValueError(
                f"RewriteMatchesScene: sample {sample_id!r} has no metadata key {self.canonical_key!r} "
                f"(keys: {sorted(metadata)}); use a ShapesPEDataset or set canonical_key"
            )
        try:
            return parse_prompt(str(metadata[self.canonical_key]))
        except ValueError as e:
            raise ValueError(f"RewriteMatchesScene: sample {sample_id!r}: {e}") from e

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts` against `req.metadata[i][canonical_key]`."""
        texts = req.require_texts("RewriteMatchesScene")
        metadata = req.metadata or [{} for _ in texts]
        scores = []
        for sid, text, meta in zip(req.sample_ids, texts, metadata, strict=True):
            want = self.reference(sid, meta)
            try:
                got = parse_prompt(text.strip())
            except ValueError:
                scores.append(0.0)
                continue
            scores.append(1.0 if same_scene(got, want) else 0.0)
        return torch.tensor(scores, dtype=torch.float32)


class CanonicalFormat:
    """Scorer: 1.0 when a response, stripped, is a prompt of the canonical grammar (`parse_prompt`
    accepts it), else 0.0. A format reward: it never looks at what the user asked for, only at
    whether the image model can read the rewrite (the PE's own reward beside its images')."""

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts`."""
        scores = []
        for text in req.require_texts("CanonicalFormat"):
            try:
                parse_prompt(text.strip())
            except ValueError:
                scores.append(0.0)
            else:
                scores.append(1.0)
        return torch.tensor(scores, dtype=torch.float32)
