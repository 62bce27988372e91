"""The engine worker of a unified run (one backbone that thinks and draws): Janus's plan and image
segments are two tracks sharing one backbone (`unirl.trainer.graph.RunGraph.shared`).

Per step the driver (`unirl.trainer.trainer.Trainer`) asks for one rollout: on the workers
(`unirl.trainer.worker.RLWorker`, its `Backbone`), or on dedicated engines
(`UnifiedEngineWorker`), the `UnifiedEngine` writes
a plan per sample and draws one image after prompt + plan (two tracks, `plan` and `image`,
linked by lineage, each put into the transport on its own). The image reward scores the
images; the plan's reward is its image's (the mean over its single child), so one image reward
is credited to both segments (BiCoT-GRPO); advantages per trained segment over the user
prompt's group; then one joint optimizer step (`train_joint`,
`unirl.train.joint.JointTrainStack`: the sum of the trained segments' losses, each weighted by
`tracks.<name>.weight`). A frozen segment (`tracks.<name>.trained: false`) has no loss term,
so it contributes no gradient: the plan-only and image-only ablations are one key each.

With `rollout: DedicatedUnifiedEngine` the rollouts run in engine actors with their own
backbone, synced from the train workers before every rollout (`weight_sync`), colocated
(sleeping while the trainer trains) or on devices of their own; the train workers then train
and evaluate only.
"""

from __future__ import annotations

from typing import Any

from unirl.dataplane import BatchMeta, put_batch
from unirl.distributed.cores import apply_thread_count
from unirl.distributed.group import Dispatch, dispatch
from unirl.trainer.engine_worker import EngineWorker
from unirl.trainer.worker import build, track_partition
from unirl.types.rollout_req import RolloutReq


class UnifiedEngineWorker(EngineWorker):
    """A dedicated engine of a unified run: its own backbone (with the trainer's LoRA adapter
    injected, so parameter names match the sync plan), both stages on it, and a
    `DedicatedUnifiedEngine`; a rollout puts both tracks into the transport and returns their
    metas by track. Weight sync, sleep and wake-up are `EngineWorker`'s, on the backbone."""

    pending: RolloutReq | None = None

    def build_engine(self, cfg: dict[str, Any], bundle: Any, rebuild: Any) -> Any:
        """Both tracks' stages on the one backbone (the trainer's LoRA injected and frozen), bound
        to the `DedicatedUnifiedEngine` with each track's sampling."""
        self.freeze_as_trained(bundle.model, cfg)
        order, tracks = list(cfg["rollout"]["tracks"]), cfg["tracks"]
        stages = {n: build(tracks[n]["stage"], bundle=bundle) for n in order}
        for stage in stages.values():
            stage.module = bundle.model
        engine = build(cfg["rollout"], rebuild=rebuild)
        return engine.bind(stages, {n: build(tracks[n]["sampling"]) for n in order})

    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str, chunked: bool) -> None:
        """Take this engine's shard of the root request; `rollout_next` samples it whole."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        self.pending, self.partition = req, partition

    @dispatch(Dispatch.BROADCAST)
    def rollout_next(self) -> dict[str, BatchMeta]:
        """Plans and images of the pending shard, each track put into the transport under
        `track_partition(partition, name)`; returns the metas by track."""
        if self.pending is None:
            raise RuntimeError(f"rollout_next: the rollout into {self.partition!r} has no chunk left")
        req, self.pending = self.pending, None
        resp = self.engine.generate(req)
        return {
            name: put_batch(self.transport, track_partition(self.partition, name), track)
            for name, track in resp.tracks.items()
        }
