"""`RLWorker`: one data-parallel rank holding each track's model, train stack and trainside engine.

Modality-agnostic: the recipe names the model family (`model`), its stage
(`unirl.models.stage`: a `DiffusionStage` or a `TextStage`), the algorithm and
the engine; the worker wires them and runs whatever they are.

Constructed from the resolved recipe (a plain dict), so a worker builds
exactly what the recipe names and nothing from the driver's process leaks in.
The worker computes on one device (`unirl.distributed.device`: the GPU Ray
assigned it, else the CPU): the bundle, the LoRA / EMA / reference copies, the
optimizer state, prompt encodings, noise and fetched tracks all live there;
what it returns to the driver is on the CPU. With several ranks it joins a
process group (the device's backend: NCCL on GPUs, gloo on CPU) and the
backend shards the denoiser with FSDP2; every method that touches the sharded
module is called on all ranks at once by the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from unirl.algorithms.base import StageAlgorithm
from unirl.dataplane import BatchMeta, get_batch, make_transport, put_batch
from unirl.distributed.cores import apply_thread_count, govern_threads, thread_metrics
from unirl.distributed.device import build_bundle, init_process_group, resolve_device
from unirl.distributed.group import Dispatch, RankInfo, Worker, dispatch
from unirl.rollout.dedicated import is_dedicated
from unirl.rollout.kept import KeptGraphs
from unirl.rollout.trainside import TrainsideEngine
from unirl.rollout.unified import UnifiedEngine
from unirl.sync import SyncPlan, SyncTicket, WeightSyncConfig, WeightSyncSender, make_sender, plan_for
from unirl.train.backend import TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.critic import Critic
from unirl.train.ema import EMAConfig
from unirl.train.fsdp import ParallelConfig
from unirl.train.joint import JointTrainStack
from unirl.train.sequence_parallel import sequence_parallel_degree
from unirl.train.stack import TrainStack, keep_graph_problems
from unirl.types.rollout_req import RolloutReq


def quiet_library_logs() -> None:
    """Keep diffusers / transformers to errors: their per-call notices (truncated
    prompts, shard writing) would drown the run's own output."""
    import diffusers
    import transformers

    diffusers.logging.set_verbosity_error()
    diffusers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def build(node: Any, **kwargs: Any) -> Any:
    """Instantiate a `_target_` node with plain containers; None stays None."""
    return None if node is None else instantiate(node, _convert_="all", **kwargs)


def offloads_parameters(cfg: dict[str, Any]) -> bool:
    """True when the recipe's `train.fsdp` (or a track's) offloads parameters to host memory."""
    trains = [cfg.get("train")] + [t.get("train") for t in (cfg.get("tracks") or {}).values()]
    return any(bool(((t or {}).get("fsdp") or {}).get("offload_params", False)) for t in trains)


class TransportMember(Worker):
    """A worker-group member that talks to the run's data plane through its own client
    (`transport`, set by the subclass): a train worker or a dedicated engine."""

    transport: Any

    @dispatch(Dispatch.BROADCAST)
    def dataplane_stats(self) -> dict[str, float]:
        """This member's ``dataplane/...`` totals since the last call."""
        return self.transport.stats.drain()


class ProcessWorker(TransportMember):
    """What every train worker process answers, whatever it trains: where it runs, its peak
    memory, its data-plane counters, the weight sync that feeds dedicated engines, and an orderly
    teardown. Subclasses set `device` and `transport`; a worker that feeds dedicated engines
    answers `sync_source(track)` (the `TrainBackend` whose weights a sync sends: `backend` by
    default, a track's own in a composed run)."""

    device: torch.device
    reusable_process = True
    backend: TrainBackend
    samples_from_ema: bool = False  # the rollouts sample the EMA weights: the sync sends them

    def start_process(self, cfg: dict[str, Any], device: str | None) -> None:
        """Set up this worker's process from the recipe: library logs quiet, torch threads
        (`threads_per_worker`; else the usable cores / `num_devices`, kept at the cores other
        processes leave free by a `ThreadGovernor`: `govern_threads`), the torch seed, `self.device`
        (`resolve_device`) and, with several ranks, the process group."""
        quiet_library_logs()
        govern_threads(cfg.get("threads_per_worker"), share=cfg["num_devices"])
        torch.manual_seed(cfg["seed"])
        self.device = resolve_device(device)
        self.sync_senders: dict[str | None, WeightSyncSender] = {}  # by track (None: the run's one)
        if self.rank_info.world_size > 1:
            init_process_group(self.device, host_collectives=offloads_parameters(cfg))

    def sync_source(self, track: str | None) -> tuple[TrainBackend, bool]:
        """The backend whose weights a sync of `track` sends (None: a single-track run's) and
        whether its rollouts sample that backend's EMA weights."""
        return self.backend, self.samples_from_ema

    @dispatch(Dispatch.BROADCAST)
    def process_info(self) -> dict[str, Any]:
        """Host and process id of this worker (recorded in the run's placement.json)."""
        return {"rank": self.rank_info.rank, **self.process_facts(self.device)}

    @dispatch(Dispatch.BROADCAST)
    def peak_memory_mb(self) -> dict[str, float]:
        """Peak resident memory of this worker process so far (`rss`), and on a GPU the
        peak of tensors allocated on its device (`device`), in MiB."""
        peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.device.type == "cuda":
            peak["device"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return peak

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def sync_setup(
        self, sync_cfg: dict[str, Any], num_engines: int, track: str | None = None
    ) -> tuple[SyncPlan, dict[str, Any] | None, bool]:
        """Make this rank's weight-sync sender (rank 0 transmits) of `track`'s weights (None: the
        run's one model) for `num_engines` dedicated engines: a LoRA payload with `train.lora`,
        else every weight. Returns (the plan, the endpoint engines reach rank 0's sender at,
        whether the backend sends in band)."""
        cfg = WeightSyncConfig(**sync_cfg)
        backend, _ = self.sync_source(track)
        plan = plan_for(backend.module, "lora" if backend.lora is not None else "full", cfg)
        sender = make_sender(
            cfg, plan, num_receivers=num_engines, device=self.device, source=self.rank_info.rank == 0
        )
        self.sync_senders[track] = sender
        return plan, sender.endpoint(), sender.in_band

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def sync_connect(self, track: str | None = None) -> None:
        """Join `track`'s sync transport (at once with the engines' for in-band backends)."""
        self.sync_senders[track].connect()

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def sync_send(self, version: int, track: str | None = None) -> tuple[SyncTicket | None, dict[str, float]]:
        """Send `track`'s weights the rollouts sample (the EMA weights when the algorithm samples
        from them) as `version`; every rank joins the gathers of sharded weights. Returns rank 0's
        ticket and `sync/...` stats."""
        backend, from_ema = self.sync_source(track)
        sender = self.sync_senders[track]
        with backend.ema_weights() if from_ema else contextlib.nullcontext():
            ticket = sender.send(backend.module.named_parameters(), version)
        return ticket, dict(sender.stats)

    @dispatch(Dispatch.BROADCAST)
    def teardown(self) -> None:
        """Detach from the transport and the weight sync and leave the process group before
        the actor is killed (avoids gloo aborts at exit)."""
        self.transport.close()
        for sender in self.sync_senders.values():
            sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def track_partition(partition: str, track: str) -> str:
    """The data-plane partition of one track of a composed step (each track is put on its own)."""
    return f"{partition}/{track}"


@dataclass
class TrackParts:
    """One track on one worker: its bundle and stage, and when trained its backend, algorithm and
    stack (None for a frozen track); the engine that samples its training rollouts here
    (`sampler`) and, in a single-track run, the one that samples its evaluations (`eval_sampler`:
    the policy on this module; a chain evaluates through its engine, `RLWorker.sample_eval`);
    PPO's colocated critic; whether its rollouts record the reference policy's token log-probs (`kl_in_reward`) or sample the EMA weights, and whether the Adam moments leave the
    device while it samples."""

    name: str
    bundle: Any
    stage: Any
    backend: TrainBackend | None = None
    algorithm: StageAlgorithm | None = None
    stack: TrainStack | None = None
    critic: Critic | None = None
    kl_in_reward: bool = False
    offload_optimizer: bool = False
    sampler: Any = None
    eval_sampler: Any = None

    @property
    def trained(self) -> bool:
        return self.backend is not None

    @property
    def from_ema(self) -> bool:
        """Its rollouts sample the EMA weights (the algorithm asks: CRD)."""
        return self.trained and self.algorithm.requires_ema_rollout

    @property
    def kept(self) -> KeptGraphs | None:
        """The graphs its sampler keeps from `rollout` to `train` (`keep_graph`), else None."""
        return getattr(self.sampler, "kept", None)


def train_backend(
    module: torch.nn.Module,
    train: dict[str, Any],
    total_optimizer_steps: int,
    bundle: Any,
    algorithms: list[StageAlgorithm],
    keep_reference: bool,
    **extra: Any,
) -> TrainBackend:
    """The `TrainBackend` of `module` from a recipe's `train` node (LoRA, optimizer, FSDP2, mesh, EMA),
    keeping the EMA snapshots `algorithms` name (one backend may serve several: a shared
    backbone's segments) and exporting through `bundle.write_weights`; `extra` goes to the backend
    (`groups_share_samples`, `frozen`, `roots`)."""
    return TrainBackend(
        module,
        build(train.get("lora")),
        build(train["optim"]),
        total_optimizer_steps,
        fsdp=build(train.get("fsdp")),
        parallel=ParallelConfig.of(train.get("parallel")),
        ema=build(train.get("ema")),
        snapshots={n: EMAConfig(**spec) for a in algorithms for n, spec in a.snapshots.items()},
        keep_reference=keep_reference,
        writer=bundle.write_weights,
        **extra,
    )


def build_track(
    name: str,
    cfg: dict[str, Any],
    total_optimizer_steps: int,
    base_dir: str | None,
    rank: int,
    device: torch.device,
    shares_samples: bool = False,
) -> TrackParts:
    """Build track `name` from its recipe node `cfg` on `device` (a single-track recipe's root, or
    a composed recipe's `tracks.<name>`); rank 0 writes the untrained bundle to `base_dir` (tiny
    models) before LoRA is injected. `shares_samples`: the ranks of a sequence-parallel group
    train on one shard (`TrainBackend(groups_share_samples=...)`). The samplers are set after."""
    bundle = build_bundle(build(cfg["model"]), device)
    if base_dir and rank == 0:
        bundle.save_pretrained(base_dir)
    stage = build(cfg["stage"], bundle=bundle)
    if not cfg.get("trained", True):
        stage.module.requires_grad_(False)
        stage.module.eval()
        return TrackParts(name, bundle, stage)
    algorithm = build(cfg["algorithm"])
    # KL folded into the reward: the rollout records the reference policy's token log-probs
    kl_in_reward = float((cfg.get("advantage") or {}).get("kl_coef", 0) or 0) > 0
    train = cfg["train"]
    backend = train_backend(
        stage.module,
        train,
        total_optimizer_steps,
        bundle,
        [algorithm],
        keep_reference=algorithm.needs_reference_policy or kl_in_reward,
        groups_share_samples=shares_samples,
    )
    stage.module = backend.module
    stack = TrainStack(stage, backend, algorithm, build(train["stack"]))
    critic = None
    if cfg.get("critic") is not None:  # PPO's critic, colocated: it values this track's rollouts
        critic = Critic(
            build(cfg["critic"]),
            stack.config,
            build(cfg["advantage"]),
            total_optimizer_steps,
            device,
            policy=stage,
        )
    return TrackParts(
        name,
        bundle,
        stage,
        backend,
        algorithm,
        stack,
        critic=critic,
        kl_in_reward=kl_in_reward,
        offload_optimizer=bool(train.get("offload_optimizer_during_rollout", False)),
    )


def sampler_of(node: dict[str, Any] | None, stage: Any, name: str | None) -> Any:
    """The engine that samples a track's training rollouts on this worker, from its engine node:
    the node's own engine when it samples here (trainside, with or without kept graphs, or the
    demonstrations of a supervised track); a trainside engine for a track a dedicated engine
    samples (this worker then samples only its evaluations). `name`: a composed track's name."""
    named = {} if name is None else {"track_name": name}
    if is_dedicated(node):
        return TrainsideEngine(stage, node.get("forward_batch_size"), **named)
    return build(node, stage=stage, **named)


class SegmentAlgorithms:
    """The trained tracks' algorithms of a shared backbone as one checkpointable state (name -> state)."""

    def __init__(self, algorithms: dict) -> None:
        self.algorithms = algorithms

    def state_dict(self) -> dict[str, Any]:
        return {n: a.state_dict() for n, a in self.algorithms.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, a in self.algorithms.items():
            a.load_state_dict(state.get(n, {}))


@dataclass
class Backbone:
    """Tracks sharing one model (a unified recipe's plan and image segments, Janus): one bundle,
    one `TrainBackend`, a `JointTrainStack` over the trained tracks (their weighted losses, one
    optimizer step), their algorithms' state, and the engine that samples every track in one
    call (`UnifiedEngine`: a plan, then an image after prompt + plan)."""

    bundle: Any
    backend: TrainBackend
    joint: JointTrainStack
    algorithms: SegmentAlgorithms
    engine: UnifiedEngine


def build_backbone(
    cfg: dict[str, Any], total_optimizer_steps: int, base_dir: str | None, rank: int, device: torch.device
) -> tuple[Backbone, dict[str, TrackParts]]:
    """Build a unified recipe's backbone on `device` (rank 0 writes the untrained bundle to
    `base_dir` first) and a `TrackParts` per `tracks.<name>` on it: its stage on the shared
    module, the shared backend and its algorithm when trained, the shared engine as sampler."""
    bundle = build_bundle(build(cfg["model"]), device)
    if base_dir and rank == 0:
        bundle.save_pretrained(base_dir)
    order, tracks = list(cfg["rollout"]["tracks"]), cfg["tracks"]
    stages = {n: build(tracks[n]["stage"], bundle=bundle) for n in order}
    trained = [n for n in order if tracks[n].get("trained", True)]
    algorithms = {n: build(tracks[n]["algorithm"]) for n in trained}
    train = cfg["train"]
    backend = train_backend(
        bundle.model,
        train,
        total_optimizer_steps,
        bundle,
        list(algorithms.values()),  # every segment's EMA snapshots (the algorithms name them apart)
        keep_reference=any(a.needs_reference_policy for a in algorithms.values()),
        frozen=tuple(getattr(bundle, "frozen_modules", ())),
        roots=tuple(getattr(bundle, "fsdp_roots", ())),
    )
    for stage in stages.values():
        stage.module = backend.module
    segments = SegmentAlgorithms(algorithms)
    weights = {n: float(tracks[n].get("weight", 1.0)) for n in trained}
    joint = JointTrainStack(stages, backend, algorithms, weights, build(train["stack"]))
    node = cfg["rollout"]
    engine = UnifiedEngine(order, node.get("forward_batch_size"), node.get("prompt_key", "user_prompt"))
    engine.bind(stages, {n: build(tracks[n]["sampling"]) for n in order})
    parts = {
        n: TrackParts(
            n, bundle, stages[n], backend if n in algorithms else None, algorithms.get(n), sampler=engine
        )
        for n in order
    }
    return Backbone(bundle, backend, joint, segments, engine), parts


class RLWorker(ProcessWorker):
    """A train rank of an RL run of any kind and modality; it also samples the tracks whose
    rollouts are trainside.

    A single-track recipe is one track, built from the recipe's root and named by its engine
    ("diffusion" or "text"); a composed recipe (`tracks`) one per `tracks.<name>`, in the order
    of `rollout.tracks`, with the composed engine (`rollout`) for chained evaluation; a unified
    recipe (`tracks` sharing the one `model`) one per `tracks.<name>` on one `Backbone`, sampled
    together (`rollout` returns every track's meta by name) and trained in one joint step
    (`train_joint`). Methods that act on one track take its name (`track`; None: a single-track
    run's only one). A single-track or unified run's checkpoint and export keep their flat layout
    (`path/weights`, `path/<files>`); a composed run's are one directory per track.

    Args:
        rank_info: this rank.
        cfg: the resolved recipe as a plain dict.
        total_optimizer_steps: optimizer steps of the run (LR schedule length); a composed run's
            per trained track.
        base_model_dir: where rank 0 writes the untrained bundle before LoRA is injected (a tiny
            model's checkpoint then has a base to load onto); a composed run's per track (None:
            none).
        transport_info: what the driver's transport `start()` returned (to attach to it).
        device: the device to compute on; None decides from what Ray assigned
            (`resolve_device`). Tests and in-process drivers pass it explicitly.
    """

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        total_optimizer_steps: int | dict[str, int],
        base_model_dir: str | dict[str, str | None] | None = None,
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(rank_info)
        self.start_process(cfg, device)
        self.composed = "tracks" in cfg  # named tracks: a composed or unified recipe
        self.num_steps = int(cfg["num_steps"])
        self.sequence_parallel = 1
        self.backbone: Backbone | None = None
        rank = rank_info.rank
        if self.composed and "model" in cfg:  # the tracks share one model
            self.backbone, self.tracks = build_backbone(
                cfg, total_optimizer_steps, base_model_dir, rank, self.device
            )
            self.engine = self.backbone.engine
        elif self.composed:
            order = list(cfg["rollout"]["tracks"])
            self.tracks = {
                n: build_track(
                    n, cfg["tracks"][n], total_optimizer_steps.get(n, 0), base_model_dir[n], rank, self.device
                )
                for n in order
            }
            # chained evaluation; a track with no engine node samples through the composed engine's
            self.engine = build(cfg["rollout"]).bind(
                {n: t.stage for n, t in self.tracks.items()},
                {n: build(cfg["tracks"][n]["sampling"]) for n in order},
            )
            for n, parts in self.tracks.items():
                node = cfg["tracks"][n].get("engine")
                own = node is not None and not is_dedicated(node)
                parts.sampler = sampler_of(node, parts.stage, n) if own else self.engine.engines[n]
        else:
            self.sequence_parallel = sequence_parallel_degree(cfg)
            parts = build_track("", cfg, total_optimizer_steps, base_model_dir, rank, self.device, True)
            parts.sampler = sampler_of(cfg["rollout"], parts.stage, None)
            parts.name = parts.sampler.track_name
            # evaluation samples the policy; an engine that replays demonstrations (supervised) cannot
            parts.eval_sampler = parts.sampler
            if not getattr(parts.sampler, "samples_policy", True):
                parts.eval_sampler = TrainsideEngine(parts.stage)
            if parts.kept is not None:
                full_finetune = cfg["train"].get("lora") is None
                problems = keep_graph_problems(
                    parts.algorithm, parts.stack.config.num_updates_per_batch, full_finetune
                )
                if problems:
                    raise ValueError("; ".join(problems))
            self.tracks = {parts.name: parts}
            self.engine = parts.sampler
        self.transport = make_transport(cfg["transport"], device=self.device)
        self.transport.attach(transport_info or {})

    # ---- the tracks ---------------------------------------------------------------------------
    def track(self, name: str | None) -> TrackParts:
        """Track `name`'s parts (None: a single-track run's only track)."""
        if name is None:
            if self.composed:
                raise ValueError(f"a composed run names the track to act on, one of {list(self.tracks)}")
            return next(iter(self.tracks.values()))
        return self.tracks[name]

    # a single-track run's parts, by the names its callers (tests, benchmarks) read
    backend = property(lambda self: self.track(None).backend)
    stage = property(lambda self: self.track(None).stage)
    bundle = property(lambda self: self.track(None).bundle)
    algorithm = property(lambda self: self.track(None).algorithm)
    stack = property(lambda self: self.track(None).stack)
    critic = property(lambda self: self.track(None).critic)
    kept = property(lambda self: self.track(None).kept)

    @property
    def samplers(self) -> dict[str, Any]:
        """Each track's training sampler on this worker."""
        return {n: t.sampler for n, t in self.tracks.items()}

    def sync_source(self, track: str | None) -> tuple[TrainBackend, bool]:
        """A dedicated engine of `track` (None: the single track, or a shared backbone) is fed that
        track's weights (its EMA weights when its algorithm samples from them)."""
        if self.backbone is not None:
            return self.backbone.backend, False
        parts = self.track(track)
        if not parts.trained:
            raise ValueError(f"track {track!r} is frozen: it has no train backend to sync from")
        return parts.backend, parts.from_ema

    @dispatch(Dispatch.RANK_ZERO)
    def model_info(self) -> dict[str, Any]:
        """The stage's `model_info()` (what the driver's modality needs, e.g. the latent geometry
        that pins a sigma schedule), its trainable parameter count and the device; a composed
        run's per track."""
        shared = self.backbone.backend if self.backbone is not None else None
        info = {
            n: {
                **t.stage.model_info(),
                "num_trainable": (shared or t.backend).num_trainable if shared or t.trained else 0,
                "device": str(self.device),
            }
            for n, t in self.tracks.items()
        }
        return info if self.composed else next(iter(info.values()))

    # ---- rollout ------------------------------------------------------------------------------
    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str, track: str | None = None) -> BatchMeta | dict:
        """Sample this rank's shard of the track's request (from EMA weights when the algorithm
        asks for it) and put it into the transport under `partition`; returns its meta
        (gathered in rank order by the driver, which walks a composed run's chain). A shared
        backbone samples every track of the root request `req`, each put under
        `track_partition(partition, name)`, and returns their metas by name.

        With kept graphs (`keep_graph`) the graphs of the trained SDE steps stay on this worker
        for `train` of the same partition (graphs of another partition are dropped first;
        several rollouts into one partition add up). A text track whose advantage folds a KL
        into the reward records the reference policy's log-probs; a critic values the samples.
        Of a sequence-parallel group only the first rank puts the samples it generated with the
        others."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        if self.backbone is not None:
            resp = self.engine.generate(req)
            return {
                n: put_batch(self.transport, track_partition(partition, n), t) for n, t in resp.tracks.items()
            }
        parts = self.track(track)
        kept = parts.kept
        if kept is not None and kept.partition != partition:
            kept.clear()
            kept.partition = partition
        with contextlib.ExitStack() as stack:
            if parts.offload_optimizer:
                stack.enter_context(parts.backend.optimizer_offloaded())
            if parts.from_ema:
                stack.enter_context(parts.backend.ema_weights())
            try:
                resp = (
                    parts.sampler.generate(req, keep=True)
                    if kept is not None
                    else parts.sampler.generate(req)
                )
            except BaseException:
                if kept is not None:
                    kept.clear()
                raise
            sampled = resp.track(parts.sampler.track_name)
            if parts.kl_in_reward:
                self._attach_reference_log_probs(parts, sampled)
            if parts.critic is not None:
                parts.critic.attach_values(sampled)
        if self.rank_info.rank % self.sequence_parallel:  # a sequence-parallel group's copy
            return None
        return put_batch(self.transport, partition, sampled)

    @torch.no_grad()
    def _attach_reference_log_probs(self, parts: TrackParts, track) -> None:
        """Set `segment.ref_log_probs`: the reference policy's log-probs of the sampled tokens."""
        seg = track.segment
        with parts.backend.reference():
            ref = parts.stage.token_log_probs(seg).float()
        seg.ref_log_probs = [ref[i, : r.numel()].clone() for i, r in enumerate(seg.response_ids)]

    @dispatch(Dispatch.BROADCAST)
    def release_kept(self, partition: str) -> None:
        """Drop the graphs `rollout` kept for step partition `partition` (a composed run's track
        partitions under it included); the driver calls it when a step fails before `train`
        consumed them. A no-op for any other partition."""
        for parts in self.tracks.values():
            kept = parts.kept
            if kept is not None and (
                kept.partition is None
                or kept.partition == partition
                or kept.partition.startswith(partition + "/")
            ):
                kept.clear()

    @dispatch(Dispatch.DP_SCATTER)
    def sample_eval(
        self, req: RolloutReq, samplings: dict | None = None, feed: str = "rewrite", use_ema: bool = False
    ) -> torch.Tensor | list[str] | dict[str, Any]:
        """This rank's shard of an evaluation request (`unirl.trainer.evaluation.Evaluator`), from
        every trained track's EMA weights when `use_ema` (restored after).

        A single track: [n, 3, H, W] uint8 images (CPU) or n response texts. A chain: the root
        texts and the leaf's images ({"texts", "images"}) of the deterministic request `req` with
        the child `samplings`; `feed` is what the image model renders: "rewrite" (the root's
        texts), "user" (the user prompt itself, without a closing full stop: the floor) or
        "canonical" (`metadata["canonical"]`: the ceiling). A shared backbone's: `_sample_backbone`."""
        with contextlib.ExitStack() as weights:
            if use_ema:  # a shared backbone's tracks share one backend
                trained = {id(p.backend): p.backend for p in self.tracks.values() if p.backend is not None}
                for backend in trained.values():
                    weights.enter_context(backend.ema_weights())
            if self.backbone is not None:
                return self._sample_backbone(req, samplings, feed)
            if not self.composed:
                parts = self.track(None)
                sampled = parts.eval_sampler.generate(req).track(parts.eval_sampler.track_name)
                return sampled.media.cpu() if sampled.media is not None else list(sampled.texts)
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

    def _sample_backbone(self, req: RolloutReq, samplings: dict, feed: str) -> dict[str, Any]:
        """A shared backbone's evaluation shard: the plans and the images ([n, 3, H, W] uint8 on
        the CPU) of `req` (greedy plans). `feed`: "rewrite" (think, then draw: the images after
        prompt + plan), "user" (draw after the user prompt with no plan: the floor) or "canonical"
        (after `metadata["canonical"]` with no plan: the ceiling)."""
        if feed == "rewrite":
            resp = self.engine.generate(req, samplings)
            plan, image = (resp.track(n) for n in self.engine.tracks)
            return {"texts": list(plan.texts), "images": image.media.cpu()}
        if feed == "canonical":
            req = dataclasses.replace(req, prompts=[m["canonical"] for m in req.metadata])
        elif feed != "user":
            raise ValueError(f"feed must be rewrite, user or canonical, got {feed!r}")
        return {"texts": [""] * len(req), "images": self.engine.draw(req, samplings).cpu()}

    # ---- train --------------------------------------------------------------------------------
    @dispatch(Dispatch.DP_SCATTER)
    def train_joint(
        self, metas: dict[str, BatchMeta], rewards: dict, advantages: dict, progress: float
    ) -> dict[str, float]:
        """A shared backbone's step: fetch this rank's shard of every trained track, attach the
        driver's rewards and advantages, and run one joint step; returns this rank's metrics."""
        if self.backbone is None:
            raise ValueError("train_joint trains tracks that share one model (a unified recipe); use train")
        batches = {}
        for name, meta in metas.items():
            batch = get_batch(self.transport, meta)
            if (
                name == self.engine.tracks[1]
            ):  # image tokens from the transport: in the codebook, named if not
                self.tracks[name].stage.check_tokens(batch.segment, batch.sample_ids)
            batch.rewards = rewards[name].to(self.device)
            batch.advantages = advantages[name].to(self.device)
            batches[name] = batch
        metrics = {**self.backbone.joint.train_tracks(batches, progress), **thread_metrics()}
        self.backbone.backend.end_of_rollout()
        return metrics

    @dispatch(Dispatch.DP_SCATTER)
    def train(
        self,
        meta: BatchMeta,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        progress: float,
        track: str | None = None,
    ) -> dict[str, float]:
        """Fetch this rank's shard of the track from the transport, attach the driver's [b]
        rewards and advantages, and train; returns this rank's metrics. Graphs kept by `rollout`
        for this partition replace the replay of the steps they cover; they are dropped when this
        returns or raises. With a critic it trains first (`critic/...` metrics); during its
        warm-up steps the policy is not updated."""
        parts = self.track(track)
        if not parts.trained:
            raise ValueError(
                f"track {track!r} is frozen (tracks.{track}.trained: false); it has nothing to train"
            )
        kept = parts.kept
        try:
            batch = get_batch(self.transport, meta)
            batch.rewards, batch.advantages = rewards.to(self.device), advantages.to(self.device)
            if kept is not None and kept.partition != meta.partition:
                kept.clear()  # another step's graphs; every rank still offers its (empty) store
            metrics = {}
            if parts.critic is not None:
                metrics = parts.critic.train(batch, progress)
                warmup = round(progress * self.num_steps) < parts.critic.config.warmup_steps
                metrics["critic/warmup"] = float(warmup)
                if warmup:
                    return metrics
            metrics.update(parts.stack.train_track(batch, progress, kept=kept))
            metrics.update(thread_metrics())
        finally:
            if kept is not None:
                kept.clear()
        parts.backend.end_of_rollout()
        return metrics

    # ---- checkpoints and exports --------------------------------------------------------------
    def _layout(self, path: str, sub: str | None = None) -> dict[str, str]:
        """Where each track's files go under `path` (in `sub`, e.g. "weights"): a single-track
        run's at `path` itself, a composed run's in one directory per track."""
        base = os.path.join(path, sub) if sub else path
        if not self.composed:
            return {n: base for n in self.tracks}
        return {n: os.path.join(base, n) for n in self.tracks}

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_checkpoint(self, path: str, base_model: str | dict[str, str]) -> None:
        """Write every trained track's sharded train state (its algorithm's and critic's included)
        and its exported weights under `path` (all ranks at once)."""
        rank = self.rank_info.rank
        if self.backbone is not None:  # one backbone: its state, every track's algorithm state in it
            os.makedirs(path, exist_ok=True)
            save_train_state(path, self.backbone.backend, rank, self.backbone.algorithms)
            self.backbone.backend.save_weights(os.path.join(path, "weights"), base_model, write=rank == 0)
            return
        states, weights = self._layout(path), self._layout(path, "weights")
        for n, t in self.tracks.items():
            if not t.trained:
                continue
            os.makedirs(states[n], exist_ok=True)
            save_train_state(states[n], t.backend, rank, t.algorithm)
            if t.critic is not None:
                t.critic.save(states[n], rank)
            base = base_model[n] if isinstance(base_model, dict) else base_model
            t.backend.save_weights(weights[n], base, write=rank == 0)

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (all ranks at once)."""
        rank = self.rank_info.rank
        if self.backbone is not None:
            load_train_state(path, self.backbone.backend, rank, self.backbone.algorithms)
            return
        states = self._layout(path)
        for n, t in self.tracks.items():
            if t.trained:
                load_train_state(states[n], t.backend, rank, t.algorithm)
                if t.critic is not None:
                    t.critic.load(states[n], rank)

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_weights(self, path: str, base_model: str | dict[str, str], use_ema: bool = False) -> None:
        """Export every track under `path` (a composed run's in `path/<track>`): a trained track's
        weights in its family's library format (LoRA or full model: diffusers for the diffusion
        families, transformers / peft for causal LMs; the EMA weights with `use_ema`), a frozen
        track's whole bundle."""
        rank0 = self.rank_info.rank == 0
        if self.backbone is not None:  # the backbone in transformers' format
            with self.backbone.backend.ema_weights() if use_ema else contextlib.nullcontext():
                self.backbone.backend.save_weights(path, base_model, write=rank0)
            return
        outs = self._layout(path)
        for n, t in self.tracks.items():
            if t.trained:
                base = base_model[n] if isinstance(base_model, dict) else base_model
                with t.backend.ema_weights() if use_ema else contextlib.nullcontext():
                    t.backend.save_weights(outs[n], base, write=rank0)
            elif rank0:
                t.bundle.save_pretrained(outs[n])
