"""`RLWorker`: one data-parallel rank holding the model, the train stack and the trainside engine.

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
import os
import resource
import socket
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from unirl.dataplane import BatchMeta, get_batch, make_transport, put_batch
from unirl.distributed.cores import apply_thread_count, govern_threads, thread_metrics
from unirl.distributed.device import build_bundle, init_process_group, resolve_device
from unirl.distributed.group import Dispatch, RankInfo, Worker, dispatch
from unirl.rollout.dedicated import is_dedicated
from unirl.rollout.trainside import TrainsideEngine
from unirl.sync import SyncPlan, SyncTicket, WeightSyncConfig, WeightSyncSender, make_sender, plan_for
from unirl.train.backend import TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.critic import Critic
from unirl.train.ema import EMAConfig
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


class ProcessWorker(Worker):
    """What every train worker process answers, whatever it trains: where it runs, its peak
    memory, its data-plane counters, the weight sync that feeds dedicated engines, and an orderly
    teardown. Subclasses set `device` and `transport`; a worker that feeds dedicated engines
    answers `sync_source(track)` (the `TrainBackend` whose weights a sync sends: `backend` by
    default, a track's own in a composed run)."""

    device: torch.device
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
            init_process_group(self.device)

    def sync_source(self, track: str | None) -> tuple[TrainBackend, bool]:
        """The backend whose weights a sync of `track` sends (None: a single-track run's) and
        whether its rollouts sample that backend's EMA weights."""
        return self.backend, self.samples_from_ema

    @dispatch(Dispatch.BROADCAST)
    def process_info(self) -> dict[str, Any]:
        """Host and process id of this worker (recorded in the run's placement.json)."""
        return {
            "rank": self.rank_info.rank,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(self.device),
            "niceness": os.nice(0),
            "torch_threads": torch.get_num_threads(),
        }

    @dispatch(Dispatch.BROADCAST)
    def peak_memory_mb(self) -> dict[str, float]:
        """Peak resident memory of this worker process so far (`rss`), and on a GPU the
        peak of tensors allocated on its device (`device`), in MiB."""
        peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.device.type == "cuda":
            peak["device"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return peak

    @dispatch(Dispatch.BROADCAST)
    def dataplane_stats(self) -> dict[str, float]:
        """This worker's ``dataplane/...`` totals since the last call."""
        return self.transport.stats.drain()

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


class RLWorker(ProcessWorker):
    """A train rank of a single-track run of any modality; it also samples when the rollout is trainside.

    Args:
        rank_info: this rank.
        cfg: the resolved recipe as a plain dict.
        total_optimizer_steps: optimizer steps of the run (LR schedule length).
        base_model_dir: if set, rank 0 writes the untrained bundle there before
            LoRA is injected (a tiny model's checkpoint then has a base to load onto).
        transport_info: what the driver's transport `start()` returned (to attach to it).
        device: the device to compute on; None decides from what Ray assigned
            (`resolve_device`). Tests and in-process drivers pass it explicitly.
    """

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        total_optimizer_steps: int,
        base_model_dir: str | None = None,
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(rank_info)
        self.start_process(cfg, device)
        self.model_cfg = build(cfg["model"])
        self.bundle = build_bundle(self.model_cfg, self.device)
        if base_model_dir and rank_info.rank == 0:
            self.bundle.save_pretrained(base_model_dir)
        self.stage = build(cfg["stage"], bundle=self.bundle)
        self.algorithm = build(cfg["algorithm"])
        self.samples_from_ema = self.algorithm.requires_ema_rollout
        self.sequence_parallel = sequence_parallel_degree(cfg)
        # KL folded into the reward: the rollout records the reference policy's token log-probs
        self.kl_in_reward = float((cfg["advantage"] or {}).get("kl_coef", 0) or 0) > 0
        train = cfg["train"]
        self.backend = TrainBackend(
            self.stage.module,
            build(train.get("lora")),
            build(train["optim"]),
            total_optimizer_steps,
            fsdp=build(train.get("fsdp")),
            ema=build(train.get("ema")),
            snapshots={name: EMAConfig(**spec) for name, spec in self.algorithm.snapshots.items()},
            keep_reference=self.algorithm.needs_reference_policy or self.kl_in_reward,
            writer=self.bundle.write_weights,
            groups_share_samples=True,  # the driver scatters one shard per sequence-parallel group
        )
        self.stage.module = self.backend.module
        self.offload_optimizer = bool(train.get("offload_optimizer_during_rollout", False))
        self.stack = TrainStack(self.stage, self.backend, self.algorithm, build(train["stack"]))
        # PPO's critic, colocated: it values this worker's rollouts and trains on its shard
        self.critic = None
        if cfg.get("critic") is not None:
            critic_cfg, advantage = build(cfg["critic"]), build(cfg["advantage"])
            self.critic = Critic(
                critic_cfg,
                self.stack.config,
                advantage,
                total_optimizer_steps,
                self.device,
                policy=self.stage,
            )
        self.num_steps = int(cfg["num_steps"])
        if is_dedicated(cfg["rollout"]):  # engines sample the rollouts; this one samples evaluations
            self.engine = TrainsideEngine(self.stage, cfg["rollout"].get("forward_batch_size"))
        else:
            self.engine = build(cfg["rollout"], stage=self.stage)
        # evaluation samples the policy; an engine that replays demonstrations (supervised) cannot
        self.eval_engine = self.engine
        if not getattr(self.engine, "samples_policy", True):
            self.eval_engine = TrainsideEngine(self.stage)
        # rollout.keep_graph: the trained SDE steps' graphs, kept from `rollout` to `train` of one step
        self.kept = getattr(self.engine, "kept", None)
        if self.kept is not None:
            updates = self.stack.config.num_updates_per_batch
            full_finetune = train.get("lora") is None
            problems = keep_graph_problems(self.algorithm, updates, full_finetune)
            if problems:
                raise ValueError("; ".join(problems))
        self.transport = make_transport(cfg["transport"], device=self.device)
        self.transport.attach(transport_info or {})

    @dispatch(Dispatch.RANK_ZERO)
    def model_info(self) -> dict[str, Any]:
        """The stage's `model_info()` (what the driver's modality needs, e.g. the latent
        geometry that pins a sigma schedule), plus sizes for the log."""
        return {
            **self.stage.model_info(),
            "num_trainable": self.backend.num_trainable,
            "device": str(self.device),
        }

    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str) -> BatchMeta:
        """Generate this rank's shard of the request (from EMA weights when the
        algorithm asks for it) and put the track into the transport under
        `partition`; returns its meta (gathered in rank order by the driver).

        With `rollout.keep_graph` the graphs of the trained SDE steps stay on this
        worker for `train` of the same partition (graphs of another partition are
        dropped first; several rollouts into one partition add up)."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        if self.kept is not None and self.kept.partition != partition:
            self.kept.clear()
            self.kept.partition = partition
        with contextlib.ExitStack() as stack:
            if self.offload_optimizer:
                stack.enter_context(self.backend.optimizer_offloaded())
            if self.algorithm.requires_ema_rollout:
                stack.enter_context(self.backend.ema_weights())
            try:
                resp = (
                    self.engine.generate(req, keep=True)
                    if self.kept is not None
                    else self.engine.generate(req)
                )
            except BaseException:
                if self.kept is not None:
                    self.kept.clear()
                raise
            track = resp.track(self.engine.track_name)
            if self.kl_in_reward:
                self._attach_reference_log_probs(track)
            if self.critic is not None:
                self.critic.attach_values(track)
        if self.rank_info.rank % self.sequence_parallel:  # a sequence-parallel group's copy: its
            return None  # first rank puts the samples the group generated together
        return put_batch(self.transport, partition, track)

    @torch.no_grad()
    def _attach_reference_log_probs(self, track) -> None:
        """Set `segment.ref_log_probs`: the reference policy's log-probs of the sampled tokens."""
        seg = track.segment
        with self.backend.reference():
            ref = self.stage.token_log_probs(seg).float()
        seg.ref_log_probs = [ref[i, : r.numel()].clone() for i, r in enumerate(seg.response_ids)]

    @dispatch(Dispatch.DP_SCATTER)
    def sample_eval(self, req: RolloutReq, use_ema: bool = False) -> torch.Tensor | list[str]:
        """This rank's shard of an evaluation request: [n, 3, H, W] uint8 images (CPU) or n
        response texts, from the EMA weights when `use_ema` (restored after)."""
        with self.backend.ema_weights() if use_ema else contextlib.nullcontext():
            track = self.eval_engine.generate(req).track(self.eval_engine.track_name)
        return track.media.cpu() if track.media is not None else list(track.texts)

    @dispatch(Dispatch.DP_SCATTER)
    def train(
        self, meta: BatchMeta, rewards: torch.Tensor, advantages: torch.Tensor, progress: float
    ) -> dict[str, float]:
        """Fetch this rank's shard of the track from the transport, attach the
        driver's [b] rewards and advantages, and train; returns this rank's metrics.
        Graphs kept by `rollout` for this partition replace the replay of the steps they
        cover; they are dropped when this returns or raises. With a critic it trains first
        (`critic/...` metrics); during its warm-up steps the policy is not updated."""
        try:
            track = get_batch(self.transport, meta)
            track.rewards, track.advantages = rewards.to(self.device), advantages.to(self.device)
            if self.kept is not None and self.kept.partition != meta.partition:
                self.kept.clear()  # another step's graphs; every rank still offers its (empty) store
            metrics = {}
            if self.critic is not None:
                metrics = self.critic.train(track, progress)
                warmup = round(progress * self.num_steps) < self.critic.config.warmup_steps
                metrics["critic/warmup"] = float(warmup)
                if warmup:
                    return metrics
            metrics.update(self.stack.train_track(track, progress, kept=self.kept))
            metrics.update(thread_metrics())
        finally:
            if self.kept is not None:
                self.kept.clear()
        self.backend.end_of_rollout()
        return metrics

    @dispatch(Dispatch.BROADCAST)
    def release_kept(self, partition: str) -> None:
        """Drop the graphs `rollout` kept for `partition` (the driver calls it when a step
        fails before `train` consumed them); a no-op for any other partition."""
        if self.kept is not None and self.kept.partition in (partition, None):
            self.kept.clear()

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_checkpoint(self, path: str, base_model: str) -> None:
        """Write the sharded train state and the exported weights under `path`."""
        os.makedirs(path, exist_ok=True)
        save_train_state(path, self.backend, self.rank_info.rank, self.algorithm)
        if self.critic is not None:
            self.critic.save(path, self.rank_info.rank)
        self.backend.save_weights(os.path.join(path, "weights"), base_model, write=self.rank_info.rank == 0)

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, path: str) -> None:
        """Restore the train state written by `save_checkpoint`, the algorithm's state
        included, and the critic's (all ranks at once)."""
        load_train_state(path, self.backend, self.rank_info.rank, self.algorithm)
        if self.critic is not None:
            self.critic.load(path, self.rank_info.rank)

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def save_weights(self, path: str, base_model: str, use_ema: bool = False) -> None:
        """Export the trained weights (LoRA or full model, in the family's library format:
        diffusers for the diffusion families, transformers / peft for causal LMs); the EMA weights in their
        place when `use_ema`."""
        with self.backend.ema_weights() if use_ema else contextlib.nullcontext():
            self.backend.save_weights(path, base_model, write=self.rank_info.rank == 0)
