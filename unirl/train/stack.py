"""`TrainStack`: the per-rank mini-batch loop over one track."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unirl.algorithms.base import StageAlgorithm
from unirl.models.stage import module_device
from unirl.rollout.kept import KeptGraphs
from unirl.train.backend import TrainBackend
from unirl.types.batch import even_chunks
from unirl.types.constraints import AtLeastOne, check_fields
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


@dataclass
class TrainStackConfig:
    """Batch geometry of training on one rank.

    Attributes:
        micro_batch_size: samples per forward/backward; must divide the
            per-rank batch. Gradients of all micro-batches accumulate into
            one optimizer step.
        num_updates_per_batch: passes over the rollout (PPO epochs); pi_old
            stays frozen across them.
        num_mini_batches: optimizer steps per pass (PPO mini-batches): the
            per-rank batch's micro-batches split into this many contiguous
            groups, each accumulated into one step; must divide the number of
            micro-batches. 1: one step per pass over the whole batch.
        offload_activations: the tensors autograd saves for backward go to pinned host memory
            as the forward saves them and come back for the backward
            (`torch.autograd.graph.save_on_cpu`): a GPU's activation memory for PCIe traffic.
            GPU workers only (on a CPU worker they already are in host memory: refused). Graphs
            kept at sampling (`rollout.keep_graph`) are not offloaded.
    """

    micro_batch_size: AtLeastOne = 4
    num_updates_per_batch: AtLeastOne = 1
    num_mini_batches: AtLeastOne = 1
    offload_activations: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "train.stack.")

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: passes x mini-batches."""
        return self.num_updates_per_batch * self.num_mini_batches


def keep_graph_problems(
    algorithm: StageAlgorithm, num_updates: int, full_finetune: bool, key: str = "rollout"
) -> list[str]:
    """Why graphs kept at sampling (`rollout.keep_graph`) cannot stand in for the replay
    forward of this run; empty when they can. The kept graph is the sampling forward's,
    so it must be the forward the loss would replay: the same weights (one update per
    rollout, no EMA rollouts, no in-place weight swap before the backward). `key`: the engine
    node the problems name (a composed track's `engine`)."""
    name = type(algorithm).__name__
    problems = []
    if not algorithm.supports_kept_graph:
        problems.append(
            f"{key}.keep_graph: {name} cannot train from graphs kept at sampling; set {key}.keep_graph=false"
        )
    if num_updates > 1:
        problems.append(
            f"{key}.keep_graph: a kept graph is the sampling weights' forward, valid for the first update only, "
            f"but train.stack.num_updates_per_batch={num_updates}; set it to 1 or {key}.keep_graph=false"
        )
    if algorithm.requires_ema_rollout:
        problems.append(
            f"{key}.keep_graph: {name} samples from the EMA weights, not the trained ones; "
            f"set {key}.keep_graph=false"
        )
    if full_finetune and algorithm.needs_reference_policy:
        problems.append(
            f"{key}.keep_graph: a full fine-tune (train.lora: null) evaluates its KL reference by copying the "
            "reference weights into the live ones, which invalidates the kept graphs; use LoRA, a zero KL "
            f"coefficient, or {key}.keep_graph=false"
        )
    return problems


def same_on_every_rank(value: int, device: torch.device) -> bool:
    """Whether every data-parallel rank passed this `value` (collective: all ranks call it)."""
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]) == value and int(both[1]) == -value


def reduce_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every key; `*/min` keys take the min and `*/max` keys the max."""
    out: dict[str, float] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows if key in r]
        if key.endswith("/min"):
            out[key] = min(vals)
        elif key.endswith("/max"):
            out[key] = max(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


class TrainStack:
    """Runs one algorithm over one track's shard on this rank.

    `train_track(track, progress)`: splits the shard into micro-batches,
    freezes pi_old on each (`algorithm.prepare_segment`), then runs
    `num_updates_per_batch` passes, each of `num_mini_batches` optimizer steps
    accumulating gradients over a mini-batch's micro-batches (the whole batch by
    default). Returns metrics averaged over micro-batches and updates, plus
    `ratio/first_update_mean` (the first step's; 1.0 exactly when on-policy and
    pi_old is replayed), backend metrics and what the algorithm's
    `end_of_rollout` adds (called last, on every rank).
    """

    def __init__(
        self, stage, backend: TrainBackend, algorithm: StageAlgorithm, config: TrainStackConfig
    ) -> None:
        if config.steps_per_rollout > 1 and not algorithm.supports_multi_update:
            raise ValueError(
                f"train.stack.num_updates_per_batch={config.num_updates_per_batch} and num_mini_batches="
                f"{config.num_mini_batches} but {type(algorithm).__name__} does not support multiple updates "
                "per rollout"
            )
        device = module_device(stage.module) if config.offload_activations else None
        if device is not None and device.type != "cuda":
            raise ValueError(
                f"train.stack.offload_activations needs a GPU worker; this one computes on {device}, where "
                "the saved tensors already are in host memory: set it to false"
            )
        self.stage = stage
        self.backend = backend
        self.algorithm = algorithm
        self.config = config

    def prepare(
        self, track: RolloutTrack, progress: float, kept: KeptGraphs | None = None
    ) -> tuple[list[RolloutTrack], dict]:
        """Split the shard into micro-batches with pi_old frozen on each (module in train
        mode); returns them and the loss context every update passes to the algorithm
        (with `kept`: `ctx["kept"]` and `ctx["deferred"]`, see `train_track`)."""
        cfg = self.config
        if len(track) % cfg.micro_batch_size:
            raise ValueError(
                f"train.stack.micro_batch_size={cfg.micro_batch_size} does not divide the per-rank batch of "
                f"{len(track)} samples"
            )
        self.stage.module.train()
        micro = [track.select(idx) for idx in even_chunks(len(track), len(track) // cfg.micro_batch_size)]
        if kept is None:
            micro = [self.algorithm.prepare_segment(self.stage, mb) for mb in micro]
        else:
            micro = [self.algorithm.prepare_segment(self.stage, mb, kept=kept) for mb in micro]
        ctx = {
            "loss_scale": self.backend.loss_multiplier / len(micro),
            "progress": progress,
            "reference": self.backend.reference,
        }
        if self.backend.ema is not None:  # the EMA weights, for a loss that measures a KL to them (AWM)
            ctx["ema"] = self.backend.ema_weights
        if self.backend.snapshots:  # the loss's own snapshots (DGPO's EMA reference, CRD's old policy)
            ctx["snapshots"] = {
                name: functools.partial(self.backend.snapshot_weights, name)
                for name in self.backend.snapshots
            }
        if kept is not None:
            ctx.update(kept=kept, deferred=[])
        if isinstance(track.segment, TokenSegment):
            ctx.update(self.batch_totals(track.segment))
        return micro, ctx

    def batch_totals(self, segment: TokenSegment) -> dict[str, float]:
        """`num_tokens` and `num_samples` of the global train batch divided by the world
        size (all-reduced over data-parallel ranks). A micro-batch loss normalised by
        them sums, over micro-batches and then averaged over ranks by the gradient
        reduction, to the exact global token- or sequence-mean whatever the split. Under
        sequence parallelism the P ranks of a group hold the same samples, each back-propagating
        its tokens' share: the all-reduced totals count every sample P times, so they are
        divided by P (`TrainBackend.loss_multiplier`) as well, which scales the losses by P as the
        multiplier does elsewhere (FSDP's average runs over every rank)."""
        device = module_device(self.stage.module)
        totals = torch.tensor(
            [float(segment.response_lengths.sum()), float(len(segment))], dtype=torch.float64, device=device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
            totals /= dist.get_world_size() * self.backend.loss_multiplier
        num_tokens, num_samples = totals.tolist()
        return {"num_tokens": num_tokens, "num_samples": num_samples}

    def mini_batches(
        self, track: RolloutTrack, micro: list[RolloutTrack], ctx: dict
    ) -> list[tuple[list[RolloutTrack], dict]]:
        """The micro-batches grouped into `num_mini_batches` contiguous mini-batches, each with
        its loss context: `loss_scale` over its micro-batches and, for text, the totals of the
        mini-batch over the ranks (`batch_totals`), so each step's loss is its mini-batch's
        aggregate. One mini-batch: the batch's own context, unchanged."""
        n = self.config.num_mini_batches
        if n == 1:
            return [(micro, ctx)]
        if len(micro) % n:
            raise ValueError(
                f"train.stack.num_mini_batches={n} does not divide the {len(micro)} micro-batches of the "
                f"per-rank batch ({len(track)} samples / micro_batch_size {self.config.micro_batch_size})"
            )
        per = len(micro) // n
        size = per * self.config.micro_batch_size
        out = []
        for j in range(n):
            mini_ctx = {**ctx, "loss_scale": self.backend.loss_multiplier / per}
            if isinstance(track.segment, TokenSegment):
                mini = track.select(list(range(j * size, (j + 1) * size)))
                mini_ctx.update(self.batch_totals(mini.segment))
            out.append((micro[j * per : (j + 1) * per], mini_ctx))
        return out

    def backward(self, micro: list[RolloutTrack], ctx: dict) -> list[dict[str, float]]:
        """Accumulate one update's gradients over all micro-batches; their metric rows."""
        offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=True)
            if self.config.offload_activations
            else contextlib.nullcontext()
        )
        with offload:
            rows = [self.algorithm.compute_loss_and_backward(self.stage, mb, ctx) for mb in micro]
        deferred = ctx.get("deferred")
        if deferred:  # losses on kept graphs: one backward through the sampling forwards they share
            torch.stack(deferred).sum().backward()
            deferred.clear()
        return rows

    def train_track(
        self, track: RolloutTrack, progress: float, kept: KeptGraphs | None = None
    ) -> dict[str, float]:
        """One rollout's updates. `kept`: graphs kept at sampling (`rollout.keep_graph`); an
        algorithm with `supports_kept_graph` reads the pairs it covers from them instead of
        replaying and adds those losses to `ctx["deferred"]`, backpropagated together after
        every micro-batch (a graph spans the micro-batches its sampling forward held).

        With several ranks (FSDP2) the kept graphs are used only when every rank kept its
        pairs in the same layout (`KeptGraphs.layout`, one all-reduce), so every rank runs
        the same collectives; otherwise every rank replays (`keep_graph/kept_fraction` 0)."""
        offered = kept is not None
        if kept is not None and len(kept):
            problems = keep_graph_problems(
                self.algorithm, self.config.num_updates_per_batch, self.backend.lora is None
            )
            if problems:
                raise ValueError("; ".join(problems))
        else:
            kept = None
        if offered and dist.is_initialized() and dist.get_world_size() > 1:
            layout = kept.layout(track.sample_ids, track.segment.sde_indices) if kept is not None else -1
            device = module_device(self.stage.module)
            if not same_on_every_rank(layout, device):
                kept = None
        micro, ctx = self.prepare(track, progress, kept)
        minis = self.mini_batches(track, micro, ctx)
        rows, backend_rows = [], []
        self.backend.zero_grad()
        for update in range(self.config.num_updates_per_batch):
            for j, (mini, mini_ctx) in enumerate(minis):
                step_rows = self.backward(mini, mini_ctx)
                if update == 0 and j == 0:
                    first = reduce_metrics(step_rows)
                rows.extend(step_rows)
                backend_rows.append(self.backend.optimizer_step())
        out = reduce_metrics(rows)
        if "ratio/mean" in first:
            out["ratio/first_update_mean"] = first["ratio/mean"]
        if offered and kept is None:
            out["keep_graph/kept_fraction"] = 0.0
        out.update(reduce_metrics(backend_rows))
        out["train/skipped_step"] = sum(r["train/skipped_step"] for r in backend_rows)
        world = dist.get_world_size() if dist.is_initialized() else 1
        out.update(self.algorithm.end_of_rollout(self.stage, out, len(track) * world))
        return out
