"""`KeptGraphs`: autograd graphs of SDE steps kept from sampling, by (sample id, step).

On the on-policy path (one update per rollout) the replay forward of a trained
SDE step repeats the sampling forward at the same weights and inputs. A stage
that samples into a `KeptGraphs` (`DiffusionStage.diffuse(..., kept=store)`)
runs those steps with autograd on and records each step's log-prob and mean
with their graphs; the loss then reads them (`lookup`) instead of replaying and
calls backward through the sampling forward. The store lives on the worker that
sampled, between its rollout and its train call, and is bounded by `max_pairs`
(sample, step) pairs: once full, the remaining steps sample without autograd
and are replayed as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.sde.strategies import StepOutput


@dataclass
class KeptStep:
    """One SDE step of one sampling forward, with its graph.

    Attributes:
        step: the SDE step index.
        sample_ids: the b samples of the forward, in row order.
        log_prob: [b] fp32 log-prob of the sampled next latent (with graph).
        mean: [b, C, h, w] fp32 step mean (with graph).
        std_dev_t: fp32 scalar sigma_t of the step.
    """

    step: int
    sample_ids: list[str]
    log_prob: torch.Tensor
    mean: torch.Tensor
    std_dev_t: torch.Tensor


class KeptGraphs:
    """Graphs of SDE steps kept from sampling, looked up by (sample id, step).

    Args:
        max_pairs: the most (sample, step) pairs kept (None: no bound). The
            budget is spent in sampling order, one whole forward (all its
            samples at one step) at a time.

    `partition` names the rollout the graphs belong to (set by their owner);
    `clear()` drops every graph (the memory goes when nothing else holds them).
    """

    def __init__(self, max_pairs: int | None = None) -> None:
        if max_pairs is not None and max_pairs < 1:
            raise ValueError(f"rollout.keep_graph_max_pairs must be >= 1 or null, got {max_pairs}")
        self.max_pairs = max_pairs
        self.partition: str | None = None
        self._steps: list[KeptStep] = []
        self._where: dict[tuple[str, int], tuple[int, int]] = {}

    def __len__(self) -> int:
        """(sample, step) pairs kept."""
        return len(self._where)

    def room(self, n: int) -> bool:
        """Whether a forward of `n` samples at one step still fits the budget."""
        return self.max_pairs is None or len(self) + n <= self.max_pairs

    def add(self, step: int, sample_ids: list[str], out: StepOutput) -> None:
        """Keep one forward's SDE step `step`: the strategy's output `out` ([b] log-probs, [b, ...]
        means and the step's std_dev_t, with graphs)."""
        log_prob, mean, std_dev_t = out.log_prob, out.mean, out.std_dev_t
        if log_prob.shape[0] != len(sample_ids) or mean.shape[0] != len(sample_ids):
            raise ValueError(
                f"kept step {step}: {len(sample_ids)} sample ids but log_prob {list(log_prob.shape)} "
                f"and mean {list(mean.shape)}"
            )
        again = [s for s in sample_ids if (s, step) in self._where]
        if again:
            raise ValueError(f"step {step} of samples {again[:4]} is already kept")
        if not self.room(len(sample_ids)):
            raise ValueError(
                f"keeping {len(sample_ids)} more pairs exceeds rollout.keep_graph_max_pairs={self.max_pairs}"
            )
        index = len(self._steps)
        self._steps.append(KeptStep(step, list(sample_ids), log_prob, mean, std_dev_t))
        for row, s in enumerate(sample_ids):
            self._where[(s, step)] = (index, row)

    def covers(self, sample_ids: list[str], steps: list[int]) -> bool:
        """Whether every (sample, step) pair is kept."""
        return all((s, i) in self._where for i in steps for s in sample_ids)

    def layout(self, sample_ids: list[str], steps: list[int]) -> int:
        """A hash of where each (sample, step) pair sits in the store (or that it is missing),
        in order. Two ranks with equal layouts find graphs in the same places for the same
        lookups, so their backward passes run the same collectives."""
        missing = (-1, -1)
        return hash(tuple(self._where.get((s, i), missing) for s in sample_ids for i in steps)) % 2**62

    def lookup(
        self, sample_ids: list[str], steps: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kept (log_probs [b, k], means [b, k, C, h, w], std_dev_t [k]) of `sample_ids` at
        `steps`, in the shapes and order `DiffusionStage.replay` returns (graphs attached when
        grad is enabled), or None when any pair is not kept."""
        if not self.covers(sample_ids, steps):
            return None
        lps, means, stds = [], [], []
        for i in steps:
            where = [self._where[(s, i)] for s in sample_ids]
            parts = sorted({k for k, _ in where})
            if len(parts) == 1:
                kept = self._steps[parts[0]]
                lp_all, mean_all, offsets = kept.log_prob, kept.mean, {parts[0]: 0}
            else:
                chosen = [self._steps[k] for k in parts]
                lp_all = torch.cat([k.log_prob for k in chosen])
                mean_all = torch.cat([k.mean for k in chosen])
                sizes = [len(k.sample_ids) for k in chosen]
                offsets = {k: sum(sizes[:j]) for j, k in enumerate(parts)}
            rows = torch.tensor([offsets[k] + r for k, r in where], device=lp_all.device)
            lps.append(lp_all.index_select(0, rows))
            means.append(mean_all.index_select(0, rows))
            stds.append(self._steps[where[0][0]].std_dev_t)
        return torch.stack(lps, dim=1), torch.stack(means, dim=1), torch.stack(stds)

    def clear(self) -> None:
        """Drop every kept graph."""
        self._steps.clear()
        self._where.clear()
        self.partition = None
