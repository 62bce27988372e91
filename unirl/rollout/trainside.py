"""`TrainsideEngine`: the trained module samples directly (no weight sync)."""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge

from unirl.models.sd3.stage import SD3Stage
from unirl.types.batch import concat
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack


class TrainsideEngine:
    """Direct sampling through the train worker's own module.

    Args:
        stage: the diffusion stage whose `module` is the trained denoiser.
        forward_batch_size: samples per denoising forward (bounds memory);
            None runs the whole request at once. Results do not depend on it:
            each sample's noise comes from its own seed.
        track_name: name of the produced track.
    """

    def __init__(
        self,
        stage: SD3Stage,
        forward_batch_size: Annotated[int, Ge(1)] | None = None,  # Ge: checked before a stage exists
        track_name: str = "diffusion",
    ) -> None:
        if forward_batch_size is not None and forward_batch_size < 1:
            raise ValueError(f"rollout.forward_batch_size must be >= 1 or null, got {forward_batch_size}")
        self.stage = stage
        self.forward_batch_size = forward_batch_size
        self.track_name = track_name

    @torch.no_grad()
    def generate(self, req: RolloutReq) -> RolloutResp:
        sp = req.sampling
        was_training = self.stage.module.training
        self.stage.module.eval()
        try:
            cond = self.stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
            n = self.forward_batch_size or len(req)
            chunks = [list(range(k, min(k + n, len(req)))) for k in range(0, len(req), n)]
            segment = concat(
                [self.stage.diffuse(req.select(idx), {k: v[idx] for k, v in cond.items()}) for idx in chunks]
            )
            media = torch.cat([self.stage.decode(segment.final[idx]) for idx in chunks])
        finally:
            self.stage.module.train(was_training)
        track = RolloutTrack(
            name=self.track_name,
            sample_ids=req.sample_ids,
            group_ids=req.group_ids,
            prompts=req.prompts,
            metadata=req.metadata,
            segment=segment,
            conditions=cond,
            media=media,
            rollout_id=req.rollout_id,
        )
        return RolloutResp(tracks={self.track_name: track})
