"""`RolloutReq`: what the trainer asks a rollout engine to generate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.types.batch import SampleBatch
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams


@dataclass
class PromptExample:
    """One prompt row from a data source."""

    prompt: str
    prompt_id: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutReq(SampleBatch):
    """A batch of samples to generate: `len(prompts)` prompts x `samples_per_prompt`.

    Sample order is group-major: the `samples_per_prompt` siblings of a prompt
    are contiguous and share a `group_id`.

    Attributes:
        sample_ids, group_ids, prompts, metadata: per sample.
        seeds: per-sample noise seeds, fixed by the global sample index so a
            sample's noise does not depend on how the batch is split.
        init_seeds: per-sample seed of the initial noise x_T: the sample's own
            seed, or its group's first seed with `sampling.same_initial_noise`.
        sampling: the sampling params of the track's modality
            (`DiffusionSamplingParams` or `TextSamplingParams`).
        sigmas: diffusion: [T+1] fp32 sigma schedule, pinned (single source of
            truth); text: None.
        rollout_id: index of this rollout; seeds the SDE-step choice.
        sde_indices: diffusion: SDE step indices resolved for this rollout; text: [].
        parent_ids, root_ids: per sample, the lineage of a child track's request
            (`unirl.types.lineage.child_request`: the parent sample it renders, the root
            prompt's group); None for a root request. An engine copies them into its track.
    """

    sample_ids: list[str]
    group_ids: list[str]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    seeds: list[int]
    init_seeds: list[int]
    sampling: DiffusionSamplingParams | TextSamplingParams
    sigmas: torch.Tensor | None
    rollout_id: int
    sde_indices: list[int]
    parent_ids: list[str] | None = None
    root_ids: list[str] | None = None

    PER_SAMPLE = ("sample_ids", "group_ids", "prompts", "metadata", "seeds", "init_seeds", "parent_ids", "root_ids")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @classmethod
    def from_prompts(
        cls,
        examples: list[PromptExample],
        sampling: DiffusionSamplingParams | TextSamplingParams,
        sigmas: torch.Tensor | None,
        rollout_id: int,
    ) -> RolloutReq:
        """Expand each prompt into a group of `sampling.samples_per_prompt` samples
        (`sigmas`: the diffusion schedule; None for text)."""
        k = sampling.samples_per_prompt
        groups = []
        for g, ex in enumerate(examples):
            gid = f"r{rollout_id}/g{g}:{ex.prompt_id}"
            samples = [
                (f"{gid}::sample:{s}", hash((sampling.seed, rollout_id, g * k + s)) & 0x7FFF_FFFF)
                for s in range(k)
            ]
            groups.append((gid, ex.prompt, ex.metadata, samples))
        return cls.grouped(groups, sampling, sigmas, rollout_id)

    @classmethod
    def grouped(
        cls,
        groups: list[tuple[str, str, dict[str, Any], list[tuple[str, int]]]],
        sampling: DiffusionSamplingParams | TextSamplingParams,
        sigmas: torch.Tensor | None,
        rollout_id: int,
    ) -> RolloutReq:
        """The request of `groups`, each `(group_id, prompt, metadata, [(sample_id, seed), ...])`:
        its samples in order, sharing the prompt and a copy of the metadata each; a sample's
        initial-noise seed is its own, or its group's first with `sampling.same_initial_noise`.
        `sigmas` must be None for text sampling and the [num_steps + 1] fp32 schedule for diffusion."""
        text = isinstance(sampling, TextSamplingParams)
        if text != (sigmas is None):
            raise ValueError(
                f"sigmas must be None for text sampling and a schedule for diffusion sampling, got "
                f"{type(sampling).__name__} with sigmas={'None' if sigmas is None else list(sigmas.shape)}"
            )
        if not text and (sigmas.dtype != torch.float32 or sigmas.numel() != sampling.num_steps + 1):
            raise ValueError(
                f"sigmas must be fp32 with num_steps+1={sampling.num_steps + 1} entries, "
                f"got {sigmas.dtype} with {sigmas.numel()}"
            )
        same = getattr(sampling, "same_initial_noise", False)
        sample_ids, group_ids, prompts, metadata, seeds, init_seeds = [], [], [], [], [], []
        for gid, prompt, meta, samples in groups:
            for sid, seed in samples:
                sample_ids.append(sid)
                group_ids.append(gid)
                prompts.append(prompt)
                metadata.append(dict(meta))
                seeds.append(seed)
                init_seeds.append(samples[0][1] if same else seed)
        return cls(
            sample_ids=sample_ids,
            group_ids=group_ids,
            prompts=prompts,
            metadata=metadata,
            seeds=seeds,
            init_seeds=init_seeds,
            sampling=sampling,
            sigmas=sigmas,
            rollout_id=rollout_id,
            sde_indices=[] if text else sampling.resolve_sde_indices(rollout_id),
        )

    def group_firsts(self) -> dict[str, int]:
        """{group id: the index of its first sample}, in order of first appearance: the samples of
        a group share its prompt and metadata, so what a row conditions on is read there once."""
        first: dict[str, int] = {}
        for i, group in enumerate(self.group_ids):
            first.setdefault(group, i)
        return first
