"""The workers of a unified run (one backbone that thinks and draws): Janus's plan and image
segments are two tracks sharing one backbone (`unirl.trainer.graph.RunGraph.shared`).

Per step the driver (`unirl.trainer.trainer.Trainer`) asks for one rollout: on the workers
(`UnifiedWorker`), or on dedicated engines (`UnifiedEngineWorker`), the `UnifiedEngine` writes
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

import contextlib
import dataclasses
import os
from typing import Any

from omegaconf import OmegaConf

from unirl.dataplane import BatchMeta, get_batch, make_transport, put_batch
from unirl.distributed.cores import apply_thread_count, thread_metrics
from unirl.distributed.device import build_bundle
from unirl.distributed.group import Dispatch, RankInfo, Worker, dispatch
from unirl.rollout.unified import UnifiedEngine
from unirl.train.backend import TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.joint import JointTrainStack
from unirl.trainer.composed_eval import ComposedEval, ComposedEvalConfig
from unirl.trainer.engine_worker import EngineWorker
from unirl.trainer.worker import ProcessWorker, build, track_partition
from unirl.types.rollout_req import RolloutReq


class SegmentAlgorithms:
    """The trained segments' algorithms as one checkpointable state (name -> state)."""

    def __init__(self, algorithms: dict) -> None:
        self.algorithms = algorithms

    def state_dict(self) -> dict[str, Any]:
        return {n: a.state_dict() for n, a in self.algorithms.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, a in self.algorithms.items():
            a.load_state_dict(state.get(n, {}))


class UnifiedWorker(ProcessWorker):
    """The train + rollout rank of a unified run: one bundle, one stage per track on the same
    module, one `TrainBackend`, a `JointTrainStack` over the trained segments.

    Args:
        rank_info: this rank.
        cfg: the resolved recipe as a plain dict (`model`, `tracks`, `train`, `rollout`, ...).
        total_optimizer_steps: optimizer steps of the run (LR schedule length).
        base_model_dir: where rank 0 writes the untrained bundle (tiny models; None for a
            pretrained one).
        transport_info: what the driver's transport `start()` returned.
        device: the device to compute on (None: what Ray assigned, else the CPU).
    """

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        total_optimizer_steps: int,
        base_model_dir: str | None,
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(rank_info)
        self.start_process(cfg, device)
        self.bundle = build_bundle(build(cfg["model"]), self.device)
        if base_model_dir and rank_info.rank == 0:
            self.bundle.save_pretrained(base_model_dir)
        order = list(cfg["rollout"]["tracks"])
        tracks = cfg["tracks"]
        self.stages = {n: build(tracks[n]["stage"], bundle=self.bundle) for n in order}
        trained = [n for n in order if tracks[n].get("trained", True)]
        algorithms = {n: build(tracks[n]["algorithm"]) for n in trained}
        train = cfg["train"]
        self.backend = TrainBackend(
            self.bundle.model,
            build(train.get("lora")),
            build(train["optim"]),
            total_optimizer_steps,
            fsdp=build(train.get("fsdp")),
            ema=build(train.get("ema")),
            keep_reference=any(a.needs_reference_policy for a in algorithms.values()),
            writer=self.bundle.write_weights,
            frozen=tuple(getattr(self.bundle, "frozen_modules", ())),
            roots=tuple(getattr(self.bundle, "fsdp_roots", ())),
        )
        for stage in self.stages.values():
            stage.module = self.backend.module
        self.algorithms = SegmentAlgorithms(algorithms)
        self.stack = JointTrainStack(
            self.stages,
            self.backend,
            algorithms,
            {n: float(tracks[n].get("weight", 1.0)) for n in trained},
            build(train["stack"]),
        )
        # the trainside sampler (its rollouts, or only its evaluations when engines roll out)
        node = cfg["rollout"]
        self.engine = UnifiedEngine(order, node.get("forward_batch_size"), node.get("prompt_key", "user_prompt"))
        self.engine.bind(self.stages, {n: build(tracks[n]["sampling"]) for n in order})
        self.transport = make_transport(cfg["transport"], device=self.device)
        self.transport.attach(transport_info or {})

    @dispatch(Dispatch.RANK_ZERO)
    def model_info(self) -> dict[str, dict[str, Any]]:
        """Per track: its stage's `model_info()`, the backbone's trainable count and the device."""
        return {
            n: {**s.model_info(), "num_trainable": self.backend.num_trainable, "device": str(self.device)}
            for n, s in self.stages.items()
        }

    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str) -> dict[str, BatchMeta]:
        """Plans and images of this rank's shard of the root request, each track put into the
        transport under `track_partition(partition, name)`; returns the metas by track."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        resp = self.engine.generate(req)
        return {
            name: put_batch(self.transport, track_partition(partition, name), track)
            for name, track in resp.tracks.items()
        }

    @dispatch(Dispatch.DP_SCATTER)
    def sample_chain(self, req: RolloutReq, samplings: dict, feed: str = "rewrite") -> dict[str, Any]:
        """This rank's shard of an evaluation (`ComposedEval`'s `sample`): the plans and the images
        ([n, 3, H, W] uint8 on the CPU) of the deterministic request `req` (greedy plans). `feed`:
        "rewrite" (think, then draw: the plan's texts and images after prompt + plan), "user" (draw
        after the user prompt with no plan: the floor) or "canonical" (after `metadata["canonical"]`
        with no plan: the ceiling)."""
        if feed == "rewrite":
            resp = self.engine.generate(req, samplings)
            plan, image = (resp.track(n) for n in self.engine.tracks)
            return {"texts": list(plan.texts), "images": image.media.cpu()}
        if feed == "canonical":
            req = dataclasses.replace(req, prompts=[m["canonical"] for m in req.metadata])
        elif feed != "user":
            raise ValueError(f"feed must be rewrite, user or canonical, got {feed!r}")
        return {"texts": [""] * len(req), "images": self.engine.draw(req, samplings).cpu()}

    @dispatch(Dispatch.DP_SCATTER)
    def train_joint(
        self, metas: dict[str, BatchMeta], rewards: dict, advantages: dict, progress: float
    ) -> dict[str, float]:
        """Fetch this rank's shard of every trained track, attach the driver's rewards and
        advantages, and run one joint step; returns this rank's metrics."""
        batches = {}
        for name, meta in metas.items():
            batch = get_batch(self.transport, meta)
            if (
                name == self.engine.tracks[1]
            ):  # image tokens from the transport: in the codebook, named if not
                self.stages[name].check_tokens(batch.segment, batch.sample_ids)
            batch.rewards = rewards[name].to(self.device)
            batch.advantages = advantages[name].to(self.device)
            batches[name] = batch
        metrics = {**self.stack.train_tracks(batches, progress), **thread_metrics()}
        self.backend.end_of_rollout()
        return metrics

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_checkpoint(self, path: str, base_model: str) -> None:
        """The backbone's sharded train state (with every segment's algorithm state) under `path`
        and its exported weights under `path/weights` (all ranks at once)."""
        os.makedirs(path, exist_ok=True)
        save_train_state(path, self.backend, self.rank_info.rank, self.algorithms)
        self.backend.save_weights(os.path.join(path, "weights"), base_model, write=self.rank_info.rank == 0)

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (all ranks at once)."""
        load_train_state(path, self.backend, self.rank_info.rank, self.algorithms)

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_weights(self, path: str, base_model: str, use_ema: bool = False) -> None:
        """Export the backbone's trained weights to `path` in transformers' format (a LoRA
        adapter or the full model; the EMA weights with `use_ema`)."""
        with self.backend.ema_weights() if use_ema else contextlib.nullcontext():
            self.backend.save_weights(path, base_model, write=self.rank_info.rank == 0)


class UnifiedEngineWorker(EngineWorker):
    """A dedicated engine of a unified run: its own backbone (with the trainer's LoRA adapter
    injected, so parameter names match the sync plan), both stages on it, and a
    `DedicatedUnifiedEngine`; a rollout puts both tracks into the transport and returns their
    metas by track. Weight sync, sleep and wake-up are `EngineWorker`'s, on the backbone."""

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        Worker.__init__(self, rank_info)
        model_cfg, bundle = self.start_engine(cfg, device)
        self.freeze_as_trained(bundle.model, cfg)
        order, tracks = list(cfg["rollout"]["tracks"]), cfg["tracks"]
        stages = {n: build(tracks[n]["stage"], bundle=bundle) for n in order}
        for stage in stages.values():
            stage.module = bundle.model
        engine = build(cfg["rollout"], rebuild=lambda: build_bundle(model_cfg, self.device))
        self.engine = engine.bind(stages, {n: build(tracks[n]["sampling"]) for n in order})
        self.attach(cfg, transport_info)
        self.pending: RolloutReq | None = None

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


def unified_eval(node: Any, image_track: str) -> ComposedEval:
    """The composed evaluation over a unified run (`eval`, a `ComposedEvalConfig` whose `sampling`
    is the image track's `ImageTokenSamplingParams`): held-out prompts -> greedy plans -> images
    scored against `metadata[intent_key]`; the floor and the ceiling draw with no plan."""
    cfg = ComposedEvalConfig(**OmegaConf.to_container(node, resolve=True))
    examples = build(cfg.examples)
    return ComposedEval(
        list(getattr(examples, "examples", examples)),
        build(cfg.scorer),
        build(cfg.text_sampling),
        {image_track: build(cfg.sampling)},
        cfg.intent_key,
        build(cfg.rewrite_scorer),
        cfg.group_by,
        cfg.references,
    )
