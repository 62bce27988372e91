"""`TrainsideEngine`: the trained module samples directly (no weight sync)."""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge

from unirl.models.stage import DiffusionStage, TextStage
from unirl.types.batch import concat
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack


class TrainsideEngine:
    """Direct sampling through the train worker's own module, for any stage.

    Args:
        stage: a `DiffusionStage` (the track holds a `LatentSegment`, its prompt
            conditions and decoded images) or a `TextStage` (a `TokenSegment` and
            the decoded response texts); its `module` is the trained network.
        forward_batch_size: samples per forward (bounds memory); None runs the
            whole request at once. Results do not depend on it: each sample's
            randomness comes from its own seed.
        track_name: name of the produced track (default: "diffusion" for a
            diffusion stage, "text" for a text stage).
    """

    def __init__(
        self,
        stage: DiffusionStage | TextStage,
        forward_batch_size: Annotated[int, Ge(1)] | None = None,  # Ge: checked before a stage exists
        track_name: str | None = None,
    ) -> None:
        if forward_batch_size is not None and forward_batch_size < 1:
            raise ValueError(f"rollout.forward_batch_size must be >= 1 or null, got {forward_batch_size}")
        self.text = isinstance(stage, TextStage)
        if not self.text and not isinstance(stage, DiffusionStage):
            raise TypeError(f"{type(stage).__name__} implements neither DiffusionStage nor TextStage")
        self.stage = stage
        self.forward_batch_size = forward_batch_size
        self.track_name = track_name or ("text" if self.text else "diffusion")

    def _chunks(self, n: int) -> list[list[int]]:
        size = self.forward_batch_size or n
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    @torch.no_grad()
    def generate(self, req: RolloutReq) -> RolloutResp:
        was_training = self.stage.module.training
        self.stage.module.eval()
        try:
            if self.text:
                parts = [self.stage.generate(req.select(idx)) for idx in self._chunks(len(req))]
                segment = concat([seg for seg, _ in parts])
                extra = {"texts": [t for _, texts in parts for t in texts]}
            else:
                sp = req.sampling
                cond = self.stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
                chunks = self._chunks(len(req))
                segment = concat(
                    [
                        self.stage.diffuse(req.select(idx), {k: v[idx] for k, v in cond.items()})
                        for idx in chunks
                    ]
                )
                media = torch.cat([self.stage.decode(segment.final[idx]) for idx in chunks])
                extra = {"conditions": cond, "media": media}
        finally:
            self.stage.module.train(was_training)
        track = RolloutTrack(
            name=self.track_name,
            sample_ids=req.sample_ids,
            group_ids=req.group_ids,
            prompts=req.prompts,
            metadata=req.metadata,
            segment=segment,
            rollout_id=req.rollout_id,
            **extra,
        )
        return RolloutResp(tracks={self.track_name: track})
