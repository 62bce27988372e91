"""`ComposedWorker`: one data-parallel rank of a multi-track run (a prompt enhancer feeding a
diffusion model), holding one model, stage and train stack per track.

Every track of the recipe (`tracks.<name>`) gets its own bundle and stage on this
worker. A `trained` track gets its own `TrainBackend` (optimizer, LR schedule, LoRA
or full fine-tune, FSDP2 plan), algorithm and `TrainStack`; a frozen track holds
no optimizer, its parameters do not require grad and never change. The driver walks
the chain: `rollout(req, partition, track)` samples one track's shard here (a track
with `tracks.<name>.engine` is sampled by its dedicated engines instead, fed by
`sync_send(version, track)`); evaluation runs the worker's `ComposedEngine` over
every stage.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.dataplane import BatchMeta, get_batch, make_transport, put_batch
from unirl.distributed.cores import apply_thread_count, thread_metrics
from unirl.distributed.device import build_bundle
from unirl.distributed.group import Dispatch, RankInfo, dispatch
from unirl.rollout.dedicated import is_dedicated
from unirl.train.backend import TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.ema import EMAConfig
from unirl.train.stack import TrainStack
from unirl.trainer.worker import ProcessWorker, build
from unirl.types.rollout_req import RolloutReq


def track_partition(partition: str, track: str) -> str:
    """The data-plane partition of one track of a step (each track is put on its own)."""
    return f"{partition}/{track}"


@dataclass
class TrackParts:
    """One track on one worker: its bundle and stage, and when trained its backend,
    algorithm and stack (None for a frozen track)."""

    name: str
    bundle: Any
    stage: Any
    backend: TrainBackend | None = None
    algorithm: StageAlgorithm | None = None
    stack: TrainStack | None = None

    @property
    def trained(self) -> bool:
        return self.backend is not None


def build_track(
    name: str, cfg: dict[str, Any], total_optimizer_steps: int, base_dir: str | None, rank: int, device
) -> TrackParts:
    """Build track `name` from its recipe node `cfg` (`tracks.<name>`) on `device`; rank 0 writes
    the untrained bundle to `base_dir` (tiny models) before LoRA is injected."""
    bundle = build_bundle(build(cfg["model"]), device)
    if base_dir and rank == 0:
        bundle.save_pretrained(base_dir)
    stage = build(cfg["stage"], bundle=bundle)
    if not cfg.get("trained", True):
        stage.module.requires_grad_(False)
        stage.module.eval()
        return TrackParts(name, bundle, stage)
    algorithm = build(cfg["algorithm"])
    train = cfg["train"]
    backend = TrainBackend(
        stage.module,
        build(train.get("lora")),
        build(train["optim"]),
        total_optimizer_steps,
        fsdp=build(train.get("fsdp")),
        ema=build(train.get("ema")),
        snapshots={name: EMAConfig(**spec) for name, spec in algorithm.snapshots.items()},
        keep_reference=algorithm.needs_reference_policy,
        writer=bundle.write_weights,
    )
    stage.module = backend.module
    stack = TrainStack(stage, backend, algorithm, build(train["stack"]))
    return TrackParts(name, bundle, stage, backend, algorithm, stack)


class ComposedWorker(ProcessWorker):
    """A train + rollout rank of a composed run.

    Args:
        rank_info: this rank.
        cfg: the resolved recipe as a plain dict (`tracks`, `rollout`, `transport`, ...).
        total_optimizer_steps: track name -> optimizer steps of the run (LR schedule length).
        base_model_dirs: track name -> where rank 0 writes the untrained bundle (tiny models;
            None for a pretrained one).
        transport_info: what the driver's transport `start()` returned.
        device: the device to compute on (None: what Ray assigned, else the CPU).
    """

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        total_optimizer_steps: dict[str, int],
        base_model_dirs: dict[str, str | None],
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(rank_info)
        self.start_process(cfg, device)
        order = list(cfg["rollout"]["tracks"])
        self.tracks = {
            name: build_track(
                name,
                cfg["tracks"][name],
                total_optimizer_steps.get(name, 0),
                base_model_dirs[name],
                rank_info.rank,
                self.device,
            )
            for name in order
        }
        self.engine = build(cfg["rollout"]).bind(
            {n: t.stage for n, t in self.tracks.items()},
            {n: build(cfg["tracks"][n]["sampling"]) for n in order},
        )
        # each track's sampler here: its `engine` node when that is a trainside engine (e.g. with
        # kept graphs), else the composed engine's (a dedicated track's samples evaluations only)
        self.samplers = {}
        for name in order:
            node = cfg["tracks"][name].get("engine")
            if node is not None and not is_dedicated(node):
                self.samplers[name] = build(node, stage=self.tracks[name].stage, track_name=name)
            else:
                self.samplers[name] = self.engine.engines[name]
        self.transport = make_transport(cfg["transport"], device=self.device)
        self.transport.attach(transport_info or {})

    @dispatch(Dispatch.RANK_ZERO)
    def model_info(self) -> dict[str, dict[str, Any]]:
        """Per track: the stage's `model_info()`, its trainable parameter count and the device."""
        return {
            name: {
                **t.stage.model_info(),
                "num_trainable": t.backend.num_trainable if t.trained else 0,
                "device": str(self.device),
            }
            for name, t in self.tracks.items()
        }

    def sync_source(self, track: str | None) -> tuple[TrainBackend, bool]:
        """A dedicated engine of track `track` is fed that track's weights (its EMA weights when
        its algorithm samples from them)."""
        parts = self.tracks[track]
        if not parts.trained:
            raise ValueError(f"track {track!r} is frozen: it has no train backend to sync from")
        return parts.backend, parts.algorithm.requires_ema_rollout

    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str, track: str) -> BatchMeta:
        """Sample this rank's shard of `track`'s request with the track's own module (its EMA
        weights when its algorithm samples from them) and put it into the transport under
        `partition`; returns its meta. The driver walks the chain (`ComposedTrainer._rollout`)."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        parts, sampler = self.tracks[track], self.samplers[track]
        kept = sampler.kept  # the graphs of the trained SDE steps, kept for `train` of this partition
        if kept is not None and kept.partition != partition:
            kept.clear()
            kept.partition = partition
        from_ema = parts.trained and parts.algorithm.requires_ema_rollout
        with parts.backend.ema_weights() if from_ema else contextlib.nullcontext():
            try:
                sampled = sampler.generate(req, keep=kept is not None).track(track)
            except BaseException:
                if kept is not None:
                    kept.clear()
                raise
        return put_batch(self.transport, partition, sampled)

    @dispatch(Dispatch.BROADCAST)
    def release_kept(self, partition: str) -> None:
        """Drop the graphs every track kept for step partition `partition` (the driver calls it
        when a step fails before `train` consumed them)."""
        for sampler in self.samplers.values():
            kept = sampler.kept
            if kept is not None and (kept.partition is None or kept.partition.startswith(partition + "/")):
                kept.clear()

    @dispatch(Dispatch.DP_SCATTER)
    def sample_eval(self, req: RolloutReq, samplings: dict, feed: str = "rewrite") -> dict[str, Any]:
        """This rank's shard of an evaluation: the root texts and the leaf's images ([n, 3, H, W]
        uint8 on the CPU) of the deterministic request `req` with the child `samplings`.
        `feed`: what the image model renders: "rewrite" (the root stage's texts), "user" (the
        user prompt itself, without a closing full stop: the floor) or "canonical" (`metadata["canonical"]`: the ceiling)."""
        root = self.engine.tracks[0]
        override = None
        if feed == "user":  # as written, less surrounding blanks and a closing full stop (not content)
            override = {root: [p.strip().removesuffix(".").strip() for p in req.prompts]}
        elif feed == "canonical":
            override = {root: [m["canonical"] for m in req.metadata]}
        elif feed != "rewrite":
            raise ValueError(f"feed must be rewrite, user or canonical, got {feed!r}")
        resp = self.engine.generate(req, samplings=samplings, texts_override=override)
        leaf = resp.track(self.engine.tracks[-1])
        return {"texts": list(resp.track(root).texts), "images": leaf.media.cpu()}

    @dispatch(Dispatch.DP_SCATTER)
    def train(
        self, meta: BatchMeta, rewards: torch.Tensor, advantages: torch.Tensor, progress: float, track: str
    ) -> dict[str, float]:
        """Fetch this rank's shard of `track` from the transport, attach the driver's rewards and
        advantages, and run the track's train stack; returns this rank's metrics. Graphs the
        track's sampler kept for this partition replace the replay of the steps they cover and
        are dropped when this returns or raises."""
        parts = self.tracks[track]
        if not parts.trained:
            raise ValueError(
                f"track {track!r} is frozen (tracks.{track}.trained: false); it has nothing to train"
            )
        kept = self.samplers[track].kept
        try:
            batch = get_batch(self.transport, meta)
            batch.rewards, batch.advantages = rewards.to(self.device), advantages.to(self.device)
            if kept is not None and kept.partition != meta.partition:
                kept.clear()  # another step's graphs; every rank still offers its (empty) store
            metrics = {**parts.stack.train_track(batch, progress, kept=kept), **thread_metrics()}
        finally:
            if kept is not None:
                kept.clear()
        parts.backend.end_of_rollout()
        return metrics

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_checkpoint(self, path: str, base_models: dict[str, str]) -> None:
        """Write every trained track's sharded train state under `path/<track>` and its exported
        weights under `path/weights/<track>` (all ranks at once)."""
        for name, t in self.tracks.items():
            if t.trained:
                os.makedirs(os.path.join(path, name), exist_ok=True)
                save_train_state(os.path.join(path, name), t.backend, self.rank_info.rank, t.algorithm)
                t.backend.save_weights(
                    os.path.join(path, "weights", name), base_models[name], write=self.rank_info.rank == 0
                )

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> None:
        """Restore every trained track's state written by `save_checkpoint` (all ranks at once)."""
        for name, t in self.tracks.items():
            if t.trained:
                load_train_state(os.path.join(path, name), t.backend, self.rank_info.rank, t.algorithm)

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_weights(self, path: str, base_models: dict[str, str], use_ema: bool = False) -> None:
        """Export every track to `path/<track>`: a trained track's weights in its family's library
        format (LoRA or full, the EMA weights with `use_ema`), a frozen track's whole bundle."""
        rank0 = self.rank_info.rank == 0
        for name, t in self.tracks.items():
            out = os.path.join(path, name)
            if t.trained:
                with t.backend.ema_weights() if use_ema else contextlib.nullcontext():
                    t.backend.save_weights(out, base_models[name], write=rank0)
            elif rank0:
                t.bundle.save_pretrained(out)
