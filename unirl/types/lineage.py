"""Lineage of composed rollouts: the request of a child track, derived from its parent's samples.

A composed rollout (a prompt enhancer feeding a diffusion model) has a parent
track (the rewrites, one group per user prompt) and a child track (the images,
one group per rewrite). Each child sample names its parent sample
(`RolloutTrack.parent_ids`) and the root user prompt (`root_ids`). The reward
scores the leaf; the driver gives a parent an aggregate of its children's rewards
(`unirl.trainer.graph.aggregate_children`, by an `Aggregate`).
"""

from __future__ import annotations

import typing
import zlib
from typing import Literal

import torch

from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams


def child_seed(base: int, rollout_id: int, sample_id: str) -> int:
    """A 31-bit noise seed from the run seed, the rollout and the child's id: stable across
    processes (crc32, not Python's salted `hash`) and independent of how a batch is split."""
    return zlib.crc32(f"{base}/{rollout_id}/{sample_id}".encode()) & 0x7FFF_FFFF


def child_request(
    parent: RolloutTrack,
    texts: list[str],
    sampling: DiffusionSamplingParams | TextSamplingParams,
    sigmas: torch.Tensor | None,
    rollout_id: int,
    prompt_key: str = "user_prompt",
) -> RolloutReq:
    """The child stage's request: `sampling.samples_per_prompt` children of every parent sample,
    prompted with that sample's output text (`texts[i]`, the rewrite).

    Child j of parent sample `p` has id `f"{p}/{j}"` and group id `p` (a rewrite's images form a
    group); its metadata is the parent's, plus `metadata[prompt_key]` = the parent's prompt (the
    user prompt, for scoring against the user's intent) unless the parent metadata already has
    it, and `rewrite` = the text it renders. Seeds come from `child_seed`, so a child's noise
    depends only on its id, not on the data-parallel split. The request carries the lineage
    every engine copies into its track: `parent_ids` (the parent sample, = the child's group id)
    and `root_ids` (the parent's root: its `root_ids`, or its group id for a root track).
    """
    if len(texts) != len(parent):
        raise ValueError(f"child_request: {len(texts)} texts for {len(parent)} parent samples")
    groups = []
    for i, pid in enumerate(parent.sample_ids):
        meta = dict(parent.metadata[i])
        meta.setdefault(prompt_key, parent.prompts[i])
        meta["rewrite"] = texts[i]
        ids = [f"{pid}/{j}" for j in range(sampling.samples_per_prompt)]
        groups.append(
            (pid, texts[i], meta, [(sid, child_seed(sampling.seed, rollout_id, sid)) for sid in ids])
        )
    req = RolloutReq.grouped(groups, sampling, sigmas, rollout_id)
    root_of = dict(zip(parent.sample_ids, parent.root_ids or parent.group_ids, strict=True))
    req.parent_ids = list(req.group_ids)
    req.root_ids = [root_of[p] for p in req.parent_ids]
    return req


Aggregate = Literal["mean", "max", "min"]  # how a parent track's reward derives from its children's
AGGREGATES = typing.get_args(Aggregate)
