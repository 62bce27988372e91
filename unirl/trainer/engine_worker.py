"""`EngineWorker`: one dedicated rollout engine as a Ray actor (`rollout: DedicatedEngine`).

The worker builds its own copy of the model from the resolved recipe (the
same `model` and `stage` nodes the train workers build, with the same LoRA
adapter injected, so parameter names match the trainer's), wraps the stage in
a `unirl.rollout.dedicated.DedicatedEngine`, and joins the run's transport:
a rollout puts its track into the transport exactly as a train worker's
trainside rollout does, and returns the meta. It never trains and joins no
process group of the trainer's; the trainer's weights reach it through
weight sync (`unirl.sync`).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from safetensors.torch import load_file, save_file

from unirl.dataplane import BatchMeta, make_transport, put_batch
from unirl.distributed.cores import apply_thread_count, govern_threads
from unirl.distributed.device import build_bundle, resolve_device
from unirl.distributed.group import Dispatch, RankInfo, dispatch
from unirl.rollout.dedicated import EngineStateError
from unirl.sync import (
    SyncPlan,
    SyncTicket,
    WeightSyncConfig,
    WeightSyncError,
    WeightSyncReceiver,
    bind,
    make_receiver,
)
from unirl.train.backend import inject_lora
from unirl.trainer.worker import TransportMember, build, quiet_library_logs
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutTrack

WEIGHTS_FILE = "engine_weights.safetensors"


def engine_share(cfg: dict[str, Any]) -> int:
    """The processes that compute at once on a node's cores, as an engine sees them: the train
    workers, plus the engines when separate. An engine's torch threads are `threads_per_worker`
    when set, else the usable cores over this share, kept by a `ThreadGovernor` (`govern_threads`)."""
    rollout = cfg["rollout"]
    busy = int(cfg["num_devices"])
    if rollout.get("placement", "colocate") == "separate":
        busy += int(rollout.get("num_engines", 1))
    return busy


class EngineWorker(TransportMember):
    """A dedicated rollout engine: its own bundle, stage and transport client.

    Args:
        rank_info: this engine's index among the engines (`rank`) and their count.
        cfg: the resolved recipe as a plain dict (its `rollout` node is a
            `DedicatedEngine`).
        transport_info: what the driver's transport `start()` returned.
        device: the device to sample on; None decides from what Ray assigned.
    """

    def __init__(
        self,
        rank_info: RankInfo,
        cfg: dict[str, Any],
        transport_info: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(rank_info)
        model_cfg, bundle = self.start_engine(cfg, device)
        self.engine = self.build_engine(cfg, bundle, lambda: build_bundle(model_cfg, self.device))
        self.attach(cfg, transport_info)

    def build_engine(self, cfg: dict[str, Any], bundle: Any, rebuild: Any) -> Any:
        """The engine the recipe's `rollout` node names, over `bundle` with the trainer's LoRA
        injected and frozen (`rebuild()` makes a fresh bundle after a level-2 sleep): here one
        track's stage and `DedicatedEngine`."""
        stage = build(cfg["stage"], bundle=bundle)
        self.freeze_as_trained(stage.module, cfg)
        return build(cfg["rollout"], stage=stage, rebuild=rebuild)

    def start_engine(self, cfg: dict[str, Any], device: str | None) -> tuple[Any, Any]:
        """Set up this engine's process (library logs quiet, torch threads, the seed, `self.device`)
        and build its own bundle there; returns (the model config, the bundle)."""
        quiet_library_logs()
        govern_threads(cfg.get("threads_per_worker"), share=engine_share(cfg))
        torch.manual_seed(cfg["seed"])
        self.device = resolve_device(device)
        model_cfg = build(cfg["model"])
        return model_cfg, build_bundle(model_cfg, self.device)

    @staticmethod
    def freeze_as_trained(module: torch.nn.Module, cfg: dict[str, Any]) -> None:
        """Inject the trainer's LoRA adapter into `module` (so parameter names match the sync
        plan) and freeze it: an engine never trains."""
        lora = build(cfg["train"].get("lora"))
        if lora is not None:
            inject_lora(module, lora)
        module.requires_grad_(False)

    def attach(self, cfg: dict[str, Any], transport_info: dict[str, Any] | None) -> None:
        """Join the run's transport; no weight-sync receiver until `sync_setup`."""
        self.transport = make_transport(cfg["transport"], device=self.device)
        self.transport.attach(transport_info or {})
        self.receiver: WeightSyncReceiver | None = None
        self.partition = ""
        self.chunks: Iterator[RolloutTrack] = iter(())
        self.drafts: dict[str, Any] = {}  # partial rollouts in flight, by partition

    @dispatch(Dispatch.DP_SCATTER)
    def rollout(self, req: RolloutReq, partition: str, chunked: bool) -> None:
        """Start generating this engine's shard `req` into `partition`: each `rollout_next` call
        then samples and puts the next chunk, one forward batch when `chunked`, else the whole
        shard. The prompts are encoded once for the shard, as a single call would, so the
        chunks are the rows of the one-call rollout."""
        apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
        self.partition = partition
        if chunked:
            self.chunks = self.engine.generate_chunks(req)
        else:
            self.chunks = iter([self.engine.generate(req).track(self.engine.track_name)])

    @dispatch(Dispatch.BROADCAST)
    def rollout_next(self) -> BatchMeta:
        """Sample the next chunk of the started rollout, put it into the transport and return
        its meta (the driver queues these calls, so each engine runs ahead of the scoring)."""
        track = next(self.chunks, None)
        if track is None:
            raise RuntimeError(f"rollout_next: the rollout into {self.partition!r} has no chunk left")
        return put_batch(self.transport, self.partition, track)

    # ---- partial rollouts (`rollout.partial_tokens`) -----------------------------------------
    @dispatch(Dispatch.DP_SCATTER)
    def partial_start(self, req: RolloutReq, partition: str, max_tokens: int) -> None:
        """Start this engine's shard `req` of a partial rollout into `partition` and sample its
        first segment: at most `max_tokens` tokens per sample, by the weights held now."""
        apply_thread_count()
        self.drafts[partition] = self.engine.draft(req)
        self.engine.extend(self.drafts[partition], max_tokens)

    @dispatch(Dispatch.BROADCAST)
    def partial_extend(self, partition: str, max_tokens: int | None) -> None:
        """The next segment of the partial rollout into `partition`: its unfinished samples resume
        by the weights held now (synced since the last segment) for at most `max_tokens` tokens
        (None: to their end)."""
        apply_thread_count()
        draft = self._draft(partition)
        self.engine.extend(draft, draft.req.sampling.max_new_tokens if max_tokens is None else max_tokens)

    @dispatch(Dispatch.BROADCAST)
    def partial_finish(self, partition: str) -> tuple[BatchMeta, dict[str, Any]]:
        """Sample the partial rollout into `partition` to its end by the weights held now, put its
        track into the transport; returns (meta, {"tokens_by_version": {version: tokens},
        "resumed": samples whose tokens span several versions, "samples": n})."""
        apply_thread_count()
        draft = self._draft(partition)
        track = self.engine.finish(draft)
        del self.drafts[partition]
        stats = {
            "tokens_by_version": draft.version_counts(),
            "resumed": sum(int(v.unique().numel() > 1) for v in draft.versions),
            "samples": len(draft.versions),
        }
        return put_batch(self.transport, partition, track), stats

    def _draft(self, partition: str) -> Any:
        if partition not in self.drafts:
            raise RuntimeError(
                f"engine {self.rank_info.rank}: no partial rollout into {partition!r} is in flight "
                f"(in flight: {sorted(self.drafts)})"
            )
        return self.drafts[partition]

    @dispatch(Dispatch.BROADCAST)
    def save_drafts(self, path: str) -> None:
        """Write this engine's partial rollouts in flight (each one's request and draft state) to
        `<path>/engine_drafts_<rank>.pt` (a checkpoint taken with them in flight)."""
        state = {p: {"req": d.req, **d.state_dict()} for p, d in self.drafts.items()}
        torch.save(state, os.path.join(path, f"engine_drafts_{self.rank_info.rank}.pt"))

    @dispatch(Dispatch.BROADCAST)
    def load_drafts(self, path: str) -> list[str]:
        """Restore what `save_drafts` wrote (the requests re-encoded, the drafts' tokens, log-probs,
        versions and generators loaded); returns the partitions in flight."""
        saved = torch.load(os.path.join(path, f"engine_drafts_{self.rank_info.rank}.pt"), weights_only=False)
        self.drafts = {}
        for partition, state in saved.items():
            draft = self.engine.draft(state.pop("req"))
            draft.load_state_dict(state)
            self.drafts[partition] = draft
        return sorted(self.drafts)

    @dispatch(Dispatch.BROADCAST)
    def sleep(self, level: int | None = None) -> None:
        """Release the weights' memory (`DedicatedEngine.sleep`)."""
        self.engine.sleep(level)

    @dispatch(Dispatch.BROADCAST)
    def wake_up(self) -> None:
        """Restore what `sleep` released (`DedicatedEngine.wake_up`)."""
        self.engine.wake_up()

    @dispatch(Dispatch.BROADCAST)
    def sync_setup(self, sync_cfg: dict[str, Any], plan: SyncPlan, endpoint: dict[str, Any] | None) -> None:
        """Make this engine's receiver of the trainer's sync `plan` (`weight_sync` block) and
        check that the plan binds to the engine's module (`unirl.sync.bind` names every
        mismatch, and a LoRA plan that would bind zero modules)."""
        cfg = WeightSyncConfig(**sync_cfg)
        bind(self.engine.stage.module, plan)
        self.receiver = make_receiver(cfg, plan, endpoint, self.rank_info.rank, device=self.device)

    @dispatch(Dispatch.BROADCAST)
    def sync_connect(self) -> None:
        """Join the sync transport (at once with the trainer's `sync_connect` for in-band backends)."""
        self.receiver.connect()

    @dispatch(Dispatch.BROADCAST)
    def sync_receive(self, ticket: SyncTicket | None) -> dict[str, float]:
        """Receive one sync into the engine's own parameters (in place) and sample those
        weights from now on; returns the receiver's `sync/...` stats."""
        if self.engine.asleep:
            raise EngineStateError("a sync into an asleep engine: wake_up() first")
        plan = self.receiver.plan
        self.receiver.receive(ticket, into=bind(self.engine.stage.module, plan))
        return {**self.receiver.stats, **self.engine.weights_loaded(self.receiver.version)}

    @dispatch(Dispatch.RANK_ZERO)
    def save_weights(self, path: str) -> None:
        """Write the synced tensors this engine samples with (the sync plan's payload, by
        canonical name) to `<path>/engine_weights.safetensors`, with their version."""
        tensors = bind(self.engine.stage.module, self.receiver.plan)
        meta = {"version": str(self.engine.weights_version)}
        save_file(
            {k: v.contiguous().cpu() for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE), meta
        )

    @dispatch(Dispatch.BROADCAST)
    def load_weights(self, path: str, version: int) -> None:
        """Load what `save_weights` wrote into the engine's parameters and sample them as weight
        `version` (a later sync must be newer). Names, shapes and dtypes must match the plan."""
        plan = self.receiver.plan
        saved = load_file(os.path.join(path, WEIGHTS_FILE))
        problems = plan.mismatches(saved, "checkpoint")
        if problems:
            raise WeightSyncError(
                f"{path}/{WEIGHTS_FILE} does not fit the sync plan:\n  " + "\n  ".join(problems)
            )
        with torch.no_grad():
            for name, tensor in bind(self.engine.stage.module, plan).items():
                tensor.copy_(saved[name])
        self.receiver.version = version
        self.engine.weights_loaded(version)

    @dispatch(Dispatch.BROADCAST)
    def weights_version(self) -> int | None:
        """The version (trainer step) of the weights this engine samples, None if none synced."""
        return self.engine.weights_version

    @dispatch(Dispatch.BROADCAST)
    def process_info(self) -> dict[str, Any]:
        """Host and process id of this engine (recorded in the run's placement.json)."""
        return {"engine": self.rank_info.rank, **self.process_facts(self.device)}

    @dispatch(Dispatch.BROADCAST)
    def memory_mb(self) -> dict[str, float]:
        """Resident memory of this engine now (`rss`) and its peak so far (`peak_rss`), in MiB;
        on a GPU also the tensors allocated on its device now (`device`)."""
        out = {
            "rss": psutil.Process().memory_info().rss / 2**20,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.device.type == "cuda":
            out["device"] = torch.cuda.memory_allocated(self.device) / 2**20
        return out

    reusable_process = True

    def process_reusable(self) -> bool:
        """Not after an engine that holds a server in this process (vLLM's engine core keeps
        process-wide state: one per process)."""
        return super().process_reusable() and getattr(self.engine, "close", None) is None

    @dispatch(Dispatch.BROADCAST)
    def teardown(self) -> None:
        """Detach from the transport and the sync before the actor is killed."""
        self.transport.close()
        if self.receiver is not None:
            self.receiver.close()
        close = getattr(self.engine, "close", None)  # an engine holding a server (vLLM)
        if close is not None:
            close()
