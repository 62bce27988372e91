"""DAPO: GRPO with clip-higher, token-mean aggregation and dynamic sampling.

The loss is GRPO's (`GRPO.policy_loss`) with eps_high 0.28 > eps_low 0.2 ("clip
higher", room for low-probability tokens to grow) and token-mean over the batch. It keeps
GRPO's dual clip (`clip_ratio_c` 3.0), which the DAPO paper and TRL's DAPO do not have;
`clip_ratio_c: null` drops it.
Dynamic sampling is a hook the driver calls (`dynamic_sampling_limit`, `keep_groups`): it
keeps generating batches (at most `max_num_gen_batches`) and keeps only the groups
`keep_groups` returns, those whose
rewards are not all equal (an all-equal group has zero advantage and no gradient),
until the train batch is full. Overlong shaping (a linear penalty over the last
L_cache tokens before L_max) is a reward component, not part of this loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unirl.algorithms.grpo import GRPO, GRPOConfig
from unirl.types.constraints import AtLeastOne, Positive


@dataclass
class DAPOConfig(GRPOConfig):
    """GRPO's settings with DAPO's defaults, plus the driver's dynamic sampling settings.

    Attributes:
        dynamic_sampling: drop groups whose rewards are all equal and generate more
            batches to refill the train batch.
        max_num_gen_batches: cap on the batches generated per train batch (>= 1).
    """

    eps_high: Positive = 0.28
    dynamic_sampling: bool = True
    max_num_gen_batches: AtLeastOne = 10


class DAPO(GRPO):
    """DAPO on a text track; the loss, ctx and metrics are GRPO's."""

    Config: ClassVar[type] = DAPOConfig

    def dynamic_sampling_limit(self) -> int | None:
        """`max_num_gen_batches` with `dynamic_sampling`, else None (train on every group)."""
        return self.config.max_num_gen_batches if self.config.dynamic_sampling else None

    @staticmethod
    def keep_groups(rewards: torch.Tensor, group_ids: list[str]) -> list[int]:
        """Indices (ascending) of the samples whose group's rewards are not all exactly equal
        (compared in float64). rewards: [B]; group_ids: per sample, any order."""
        if rewards.dim() != 1 or rewards.numel() != len(group_ids):
            raise ValueError(
                f"rewards must be [B] with B = len(group_ids) = {len(group_ids)}, got {list(rewards.shape)}"
            )
        r = rewards.detach().to(torch.float64).cpu().tolist()
        members: dict[str, list[int]] = {}
        for i, gid in enumerate(group_ids):
            members.setdefault(gid, []).append(i)
        varied = {gid for gid, idx in members.items() if any(r[i] != r[idx[0]] for i in idx)}
        return [i for i, gid in enumerate(group_ids) if gid in varied]
