"""`TrainsideEngine`: the trained module samples directly (no weight sync)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import torch
from annotated_types import Ge

from unirl.models.stage import DiffusionStage, TextStage
from unirl.rollout.kept import KeptGraphs
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
        keep_graph: training rollouts (`generate(req, keep=True)`) run the SDE
            steps with autograd on and keep the graphs of their log-probs and
            means in `self.kept` (a `KeptGraphs`), so an on-policy loss
            backpropagates through the sampling forward instead of replaying it
            (diffusion stages; the module must have no active dropout, since
            sampling runs in eval mode and training in train mode).
        keep_graph_max_pairs: the most (sample, SDE step) pairs kept per
            training step (None: all); steps past the budget sample without
            autograd and are replayed. Memory grows with the pairs kept: per
            pair, one sample's activations of the forward that needs gradients
            (the cond half only, with guidance and `stage.detach_uncond`).
    """

    def __init__(
        self,
        stage: DiffusionStage | TextStage,
        forward_batch_size: Annotated[int, Ge(1)] | None = None,  # Ge: checked before a stage exists
        track_name: str | None = None,
        keep_graph: bool = False,
        keep_graph_max_pairs: Annotated[int, Ge(1)] | None = None,  # Ge: checked before a stage exists
    ) -> None:
        if forward_batch_size is not None and forward_batch_size < 1:
            raise ValueError(f"rollout.forward_batch_size must be >= 1 or null, got {forward_batch_size}")
        self.text = isinstance(stage, TextStage)
        if not self.text and not isinstance(stage, DiffusionStage):
            raise TypeError(f"{type(stage).__name__} implements neither DiffusionStage nor TextStage")
        self.stage = stage
        self.forward_batch_size = forward_batch_size
        self.track_name = track_name or ("text" if self.text else "diffusion")
        self.kept = KeptGraphs(keep_graph_max_pairs) if keep_graph else None
        if keep_graph:
            check_keep_graph(stage)

    def _chunks(self, n: int) -> list[list[int]]:
        size = self.forward_batch_size or n
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    def generate(self, req: RolloutReq, keep: bool = False) -> RolloutResp:
        """Sample `req`. With `keep` (a training rollout) and `keep_graph`, the SDE
        steps' graphs are added to `self.kept` (within its budget); evaluation
        leaves `keep` off."""
        track = RolloutTrack.concat(list(self.generate_chunks(req, keep)))
        return RolloutResp(tracks={self.track_name: track})

    @torch.no_grad()
    def generate_chunks(self, req: RolloutReq, keep: bool = False) -> Iterator[RolloutTrack]:
        """`generate` one forward batch at a time: yields the track of each chunk of
        `forward_batch_size` samples (in order) as soon as it is sampled and decoded;
        their concatenation is `generate`'s track. A diffusion request's prompts are
        encoded once for the whole request (a chunk's conditions are its rows), so the
        samples do not depend on whether they are taken chunk by chunk."""
        was_training = self.stage.module.training
        self.stage.module.eval()
        try:
            if not self.text:
                cond = self.stage.encode_request(req)  # the prompts, and an edit's reference images, say
            for idx in self._chunks(len(req)):
                part = req.select(idx)
                if self.text:
                    segment, texts = self.stage.generate(part)
                    extra = {"texts": texts}
                else:
                    rows = {k: v[idx] for k, v in cond.items()}
                    segment = self.stage.diffuse(part, rows, kept=self.kept if keep else None)
                    extra = {"conditions": rows, "media": self.stage.decode(segment.final)}
                    # an audio-video family's soundtracks (FlowMatchingStage.decode_audio); other stages have none
                    decode_audio = getattr(self.stage, "decode_audio", None)
                    if decode_audio is not None:
                        extra.update(decode_audio(segment.final))
                yield RolloutTrack.of_request(self.track_name, part, segment, **extra)
        finally:
            self.stage.module.train(was_training)


def check_keep_graph(stage: DiffusionStage | TextStage) -> None:
    """Raise ValueError naming the problem unless `stage` can keep sampling graphs: a
    diffusion stage whose module has no dropout with p > 0 (sampling runs in eval mode,
    the loss in train mode; without active dropout the two are the same function)."""
    if isinstance(stage, TextStage) or not isinstance(stage, DiffusionStage):
        raise ValueError(
            f"rollout.keep_graph keeps SDE-step graphs of diffusion rollouts; {type(stage).__name__} is not a "
            "diffusion stage: set rollout.keep_graph=false"
        )
    active = [
        name
        for name, m in stage.module.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    if active:
        raise ValueError(
            f"rollout.keep_graph: the module has active dropout ({active[:3]}{'...' if len(active) > 3 else ''}); "
            "sampling runs in eval mode and the loss in train mode, so a kept graph would not be the "
            "trained function: set train.lora.dropout=0 (and no dropout in the model) or rollout.keep_graph=false"
        )
