"""`StepRecord`: the bookkeeping of one driver step, apart from what the step does.

A driver loop marks its phases (`mark`), adds the metrics its phases return to `row`, and
then asks for the figures of the machine: phase timings (`time/...`), the data plane's
counters (`dataplane/...`, summed over the workers and the driver) and the workers' peak
memory (`memory/worker_peak_<kind>_mb`). `Trainer` uses it for every kind of run, so every
run's rows name the same things the same way.
"""

from __future__ import annotations

import time
from typing import Any

from unirl.dataplane import merge_stats


class StepRecord:
    """The metrics row of step `step` (0-based; the row says `step + 1`) and its phase marks.

    Marks (`time.perf_counter()` values): "start" (set on construction), "rollout" (the rollout
    ended), "reward" (rewards and advantages done), "train" (training began; default: "reward")
    and "trained" (training ended).
    """

    def __init__(self, step: int) -> None:
        self.row: dict[str, Any] = {"step": step + 1}
        self.marks: dict[str, float] = {"start": time.perf_counter()}

    def mark(self, event: str, at: float | None = None) -> None:
        """Record `event` now, or at the `time.perf_counter()` value `at`."""
        self.marks[event] = time.perf_counter() if at is None else at

    def add_timings(self) -> None:
        """`time/rollout_s`, `time/reward_s`, `time/train_s` and `time/step_s` from the marks."""
        m = self.marks
        self.row.update(
            {
                "time/rollout_s": m["rollout"] - m["start"],
                "time/reward_s": m["reward"] - m["rollout"],
                "time/train_s": m["trained"] - m.get("train", m["reward"]),
                "time/step_s": m["trained"] - m["start"],
            }
        )

    def add_resources(self, dataplane: list[dict[str, float]], peaks: list[dict[str, float]]) -> None:
        """The summed `dataplane/...` counters of every process, and the largest peak of each
        memory kind over the workers (`rss`; `device` on GPU workers)."""
        self.row.update(merge_stats(dataplane))
        for kind in peaks[0]:
            self.row[f"memory/worker_peak_{kind}_mb"] = max(p[kind] for p in peaks)
