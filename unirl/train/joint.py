"""`JointTrainStack`: several tracks of one backbone trained in one optimizer step.

A unified model's `plan` and `image` tracks share every backbone parameter, so they cannot
each own an optimizer. Per rollout the joint stack minimizes

    L = sum_s w_s L_s

over its trained segments s (`tracks.<s>.weight` = w_s > 0; a frozen segment contributes
no term, so no gradient). Each segment's own `StageAlgorithm` (GRPO with its own
`loss_agg_mode`, clip and KL) runs on its own `TrainStack` (micro-batches, pi_old frozen,
batch totals) and calls backward on its own L_s. Between segments the accumulated gradients
are rescaled so the sum is weighted: before segment j's backward they are multiplied by
w_{j-1} / w_j and after the last by w_k, which leaves w_1 g_1 + ... + w_k g_k for any loss
(the algorithms need no weight argument and report their unweighted losses).
"""

from __future__ import annotations

import torch.distributed as dist

from unirl.algorithms.base import StageAlgorithm
from unirl.train.backend import TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig, reduce_metrics
from unirl.types.rollout_resp import RolloutTrack


class JointTrainStack:
    """Trains the segments `algorithms` names (track name -> algorithm) of one backend.

    Args:
        stages: track name -> the stage replaying that track (all on `backend.module`).
        backend: the one `TrainBackend` (optimizer, schedule, LoRA / full, clipping).
        algorithms: trained track name -> its algorithm, in training order.
        weights: trained track name -> w_s > 0.
        config: batch geometry shared by the segments (`num_mini_batches` must be 1: one
            optimizer step per pass holds every segment's whole batch).
    """

    def __init__(
        self,
        stages: dict,
        backend: TrainBackend,
        algorithms: dict[str, StageAlgorithm],
        weights: dict[str, float],
        config: TrainStackConfig,
    ) -> None:
        if not algorithms:
            raise ValueError("JointTrainStack needs at least one trained segment")
        bad = {n: weights.get(n) for n in algorithms if not (weights.get(n) or 0) > 0}
        if bad:
            raise ValueError(f"trained segments need a weight > 0, got {bad}")
        if config.num_mini_batches != 1:
            raise ValueError(
                f"train.stack.num_mini_batches={config.num_mini_batches}: a joint step holds every segment's "
                "whole batch; set it to 1"
            )
        self.backend = backend
        self.weights = {n: float(weights[n]) for n in algorithms}
        self.stacks = {n: TrainStack(stages[n], backend, a, config) for n, a in algorithms.items()}
        self.config = config

    def _scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        for p in self.backend.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def train_tracks(self, tracks: dict[str, RolloutTrack], progress: float) -> dict[str, float]:
        """One rollout's updates over `tracks` (trained name -> this rank's shard). Returns each
        segment's metrics prefixed `<name>/`, the first update's ratio per segment, and the
        backend's metrics of the joint optimizer steps."""
        names = list(self.stacks)
        missing = [n for n in names if n not in tracks]
        if missing:
            raise ValueError(f"JointTrainStack: no shard of trained track(s) {missing}")
        prepared = {n: self.stacks[n].prepare(tracks[n], progress) for n in names}
        rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        firsts: dict[str, dict[str, float]] = {}
        backend_rows = []
        self.backend.zero_grad()
        for update in range(self.config.num_updates_per_batch):
            previous = None
            for n in names:
                if previous is not None:
                    self._scale_grads(self.weights[previous] / self.weights[n])
                micro, ctx = prepared[n]
                step_rows = self.stacks[n].backward(micro, ctx)
                if update == 0:
                    firsts[n] = reduce_metrics(step_rows)
                rows[n].extend(step_rows)
                previous = n
            self._scale_grads(self.weights[previous])
            backend_rows.append(self.backend.optimizer_step())
        out: dict[str, float] = {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        for n in names:
            seg = reduce_metrics(rows[n])
            if "ratio/mean" in firsts[n]:
                seg["ratio/first_update_mean"] = firsts[n]["ratio/mean"]
            stack = self.stacks[n]
            seg.update(stack.algorithm.end_of_rollout(stack.stage, seg, len(tracks[n]) * world))
            out.update({f"{n}/{k}": v for k, v in seg.items()})
        out.update(reduce_metrics(backend_rows))
        out["train/skipped_step"] = sum(r["train/skipped_step"] for r in backend_rows)
        return out
