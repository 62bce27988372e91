"""`TrainStack`: the per-rank mini-batch loop over one track."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from unirl.algorithms.base import StageAlgorithm
from unirl.train.backend import TrainBackend
from unirl.types.batch import even_chunks
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


@dataclass
class TrainStackConfig:
    """Batch geometry of training on one rank.

    Attributes:
        micro_batch_size: samples per forward/backward; must divide the
            per-rank batch. Gradients of all micro-batches accumulate into
            one optimizer step.
        num_updates_per_batch: optimizer updates per rollout (PPO epochs);
            pi_old stays frozen across them.
    """

    micro_batch_size: int = 4
    num_updates_per_batch: int = 1

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"train.stack.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_updates_per_batch < 1:
            raise ValueError(
                f"train.stack.num_updates_per_batch must be >= 1, got {self.num_updates_per_batch}"
            )


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
    `num_updates_per_batch` optimizer updates, each accumulating gradients
    over all micro-batches. Returns metrics averaged over micro-batches and
    updates, plus `ratio/first_update_mean` (1.0 exactly when on-policy and
    pi_old is replayed), backend metrics and what the algorithm's
    `end_of_rollout` adds (called last, on every rank).
    """

    def __init__(
        self, stage, backend: TrainBackend, algorithm: StageAlgorithm, config: TrainStackConfig
    ) -> None:
        if config.num_updates_per_batch > 1 and not algorithm.supports_multi_update:
            raise ValueError(
                f"train.stack.num_updates_per_batch={config.num_updates_per_batch} but "
                f"{type(algorithm).__name__} does not support multiple updates per rollout"
            )
        self.stage = stage
        self.backend = backend
        self.algorithm = algorithm
        self.config = config

    def prepare(self, track: RolloutTrack, progress: float) -> tuple[list[RolloutTrack], dict]:
        """Split the shard into micro-batches with pi_old frozen on each (module in train
        mode); returns them and the loss context every update passes to the algorithm."""
        cfg = self.config
        if len(track) % cfg.micro_batch_size:
            raise ValueError(
                f"train.stack.micro_batch_size={cfg.micro_batch_size} does not divide the per-rank batch of "
                f"{len(track)} samples"
            )
        self.stage.module.train()
        micro = [track.select(idx) for idx in even_chunks(len(track), len(track) // cfg.micro_batch_size)]
        micro = [self.algorithm.prepare_segment(self.stage, mb) for mb in micro]
        ctx = {"loss_scale": 1.0 / len(micro), "progress": progress, "reference": self.backend.reference}
        if isinstance(track.segment, TokenSegment):
            ctx.update(self.batch_totals(track.segment))
        return micro, ctx

    def batch_totals(self, segment: TokenSegment) -> dict[str, float]:
        """`num_tokens` and `num_samples` of the global train batch divided by the world
        size (all-reduced over data-parallel ranks). A micro-batch loss normalised by
        them sums, over micro-batches and then averaged over ranks by the gradient
        reduction, to the exact global token- or sequence-mean whatever the split."""
        device = next(self.stage.module.parameters()).device
        totals = torch.tensor(
            [float(segment.response_lengths.sum()), float(len(segment))], dtype=torch.float64, device=device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
            totals /= dist.get_world_size()
        num_tokens, num_samples = totals.tolist()
        return {"num_tokens": num_tokens, "num_samples": num_samples}

    def backward(self, micro: list[RolloutTrack], ctx: dict) -> list[dict[str, float]]:
        """Accumulate one update's gradients over all micro-batches; their metric rows."""
        return [self.algorithm.compute_loss_and_backward(self.stage, mb, ctx) for mb in micro]

    def train_track(self, track: RolloutTrack, progress: float) -> dict[str, float]:
        micro, ctx = self.prepare(track, progress)
        rows, backend_rows = [], []
        self.backend.zero_grad()
        for update in range(self.config.num_updates_per_batch):
            update_rows = self.backward(micro, ctx)
            if update == 0:
                first = reduce_metrics(update_rows)
            rows.extend(update_rows)
            backend_rows.append(self.backend.optimizer_step())
        out = reduce_metrics(rows)
        if "ratio/mean" in first:
            out["ratio/first_update_mean"] = first["ratio/mean"]
        out.update(reduce_metrics(backend_rows))
        out["train/skipped_step"] = sum(r["train/skipped_step"] for r in backend_rows)
        world = dist.get_world_size() if dist.is_initialized() else 1
        out.update(self.algorithm.end_of_rollout(self.stage, out, len(track) * world))
        return out
