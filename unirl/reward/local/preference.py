"""A reward that ranks demonstrations by their label: the preference of an offline pair."""

from __future__ import annotations

import torch

from unirl.types.reward import RewardRequest


class PreferredDemonstration:
    """Scorer: 1 for a sample whose `metadata[key]` is `preferred`, else 0.

    With `unirl.rollout.demonstrations.DemonstrationEngine(target_key=[chosen, rejected])` each
    sample of a row's group is one of its demonstrations, labelled with its key under
    `metadata["demonstration"]`; this reward ranks the chosen one above the others, so a loss that
    pairs the best and the worst sample of a group (`DiffusionDPO`) trains on the data's pairs.
    Reads no image or text.

    Args:
        preferred: the label of the preferred demonstration ("chosen").
        key: the metadata key holding each sample's label.
    """

    def __init__(self, preferred: str = "chosen", key: str = "demonstration") -> None:
        self.preferred = preferred
        self.key = key

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32: 1.0 where the sample is the preferred demonstration, 0.0 elsewhere. A sample
        without the label is an error naming it."""
        if len(req.metadata) != len(req.sample_ids):
            raise ValueError("PreferredDemonstration reads each sample's metadata; the request carries none")
        out = []
        for sid, meta in zip(req.sample_ids, req.metadata, strict=True):
            if self.key not in meta:
                raise ValueError(
                    f"PreferredDemonstration: sample {sid!r} has no metadata[{self.key!r}]; it labels the "
                    "demonstrations of rollout: DemonstrationEngine with a list target_key"
                )
            out.append(1.0 if meta[self.key] == self.preferred else 0.0)
        return torch.tensor(out, dtype=torch.float32)
