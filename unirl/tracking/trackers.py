"""Trackers: where a run's metrics rows, samples and resolved config go besides `metrics.jsonl`.

A recipe lists them under `tracking` by name, each a name or `{name: ..., <options>}`:

    tracking:
      - tensorboard                        # <output_dir>/tensorboard/
      - {name: wandb, optional: true}      # offline, <output_dir>/wandb/
      - {name: console, every_n_steps: 10}

`metrics.jsonl` is always written (`JsonlWriter`, the same bytes with or without trackers).
`Tracking` runs on the driver only: it writes each row to `metrics.jsonl` and then hands the
row's numbers to every tracker, and the samples the trainer saved (`samples/step_XXXX.png` +
`.json`, or the `.json` of a text run) at the recipe's sample cadence. A tracker that fails to
start stops the run naming itself, unless its entry says `optional: true`: then a warning
naming it goes to stderr and the run goes on without it (the same for a later failure of an
optional tracker). `tracker_problems` checks a `tracking` node before Ray (the validator calls it).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, TextIO

import numpy as np
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from unirl.tracking.metrics import JsonlWriter

__all__ = [
    "TRACKERS",
    "ConsoleTracker",
    "Samples",
    "TensorBoardTracker",
    "Tracker",
    "TrackerError",
    "Tracking",
    "WandbTracker",
    "tracker_problems",
]


class TrackerError(RuntimeError):
    """A required tracker failed: names the tracker and its entry in `tracking`."""


@dataclass
class Samples:
    """The samples the trainer saved for one step.

    Attributes:
        stem: the files' path without extension (`<run>/samples/step_0010`).
        grid: the image grid, [H, W, 3] uint8, or None for a text run.
        entries: one dict per sample (`prompt`, `reward`; a text run also `response`,
            `response_tokens`), in the grid's row-major order.
    """

    stem: str
    grid: np.ndarray | None
    entries: list[dict[str, Any]]

    @classmethod
    def read(cls, stem: str) -> Samples:
        """The grid `<stem>.png` (if there is one) and the entries of `<stem>.json`."""
        grid = None
        if os.path.isfile(stem + ".png"):
            with Image.open(stem + ".png") as im:
                grid = np.asarray(im.convert("RGB"))
        with open(stem + ".json", encoding="utf-8") as f:
            entries = json.load(f)
        return cls(stem, grid, [e if isinstance(e, dict) else {"prompt": e} for e in entries])

    def markdown(self) -> str:
        """The entries as a Markdown table (index, reward, prompt, and the response of a text run)."""
        text = any("response" in e for e in self.entries)
        lines = [
            "| # | reward | prompt |" + (" response |" if text else ""),
            "|---|---|---|" + ("---|" if text else ""),
        ]
        for i, e in enumerate(self.entries):
            cells = [str(i), _reward(e.get("reward")), _cell(e.get("prompt", ""))]
            if text:
                cells.append(_cell(e.get("response", "")))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _reward(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "—"


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


class Tracker:
    """One destination of a run's numbers and samples. A subclass sets `name` (its key in
    `TRACKERS`), takes its options as constructor keywords (checked before Ray: a constructor
    only checks them, nothing starts before `start`), and overrides what it records."""

    name: ClassVar[str]

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        """Open the destination for the run in `run_dir`, with the resolved recipe `config`."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """The numbers of one metrics row (`step` removed)."""

    def log_samples(self, step: int, samples: Samples) -> None:
        """The samples saved at `step`."""

    def close(self) -> None:
        """Flush and close; called once, also after a failed run."""


class ConsoleTracker(Tracker):
    """One line per `every_n_steps` steps on stdout: `step N key=value ...` for the row's keys
    named in `keys` (a key ending in `*` matches every key it prefixes), in that order."""

    name = "console"

    def __init__(
        self,
        keys: tuple[str, ...] = ("reward/mean", "loss", "eval/*", "time/step_s"),
        every_n_steps: int = 1,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.keys = list(keys)
        self.every_n_steps = every_n_steps
        self.stream: TextIO = sys.stdout

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        self.stream = sys.stdout  # the stream of the run (a test may have replaced it since construction)
        print(f"run {run_dir}", file=self.stream, flush=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        if step % self.every_n_steps and not any(k.startswith("eval/") for k in scalars):
            return
        shown = []
        for key in self.keys:
            match = [k for k in sorted(scalars) if k.startswith(key[:-1])] if key.endswith("*") else [key]
            shown += [f"{k}={scalars[k]:.4g}" for k in match if k in scalars]
        print(f"step {step} " + " ".join(shown), file=self.stream, flush=True)

    def log_samples(self, step: int, samples: Samples) -> None:
        print(
            f"step {step} samples: {samples.stem}.{'png' if samples.grid is not None else 'json'}",
            file=self.stream,
            flush=True,
        )


class TensorBoardTracker(Tracker):
    """Event files in `<run_dir>/<subdir>` (`tensorboard --logdir <run_dir>`): every number of a
    row as a scalar at its step, the sample grid as the image `samples` and the samples as the
    text `samples` (a Markdown table), and the resolved recipe as the text `config`. Needs the
    `tensorboard` package (`pip install -e '.[tracking]'`)."""

    name = "tensorboard"

    def __init__(self, subdir: str = "tensorboard") -> None:
        self.subdir = subdir
        self.writer = None

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, self.subdir))
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, step: int, samples: Samples) -> None:
        if samples.grid is not None:
            self.writer.add_image("samples", samples.grid, step, dataformats="HWC")
        self.writer.add_text("samples", samples.markdown(), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in `<run_dir>/wandb/` (offline by default: `wandb sync <that dir>/offline-run-*`
    uploads it later): every number of a row at its step, the sample grid as the image
    `samples` (captioned with the prompts) and the samples as the table `samples_table`, the
    resolved recipe as the run's config. Needs the `wandb` package (`pip install -e '.[tracking]'`)."""

    name = "wandb"
    MODES: ClassVar[tuple[str, ...]] = ("offline", "online", "disabled")

    def __init__(
        self,
        project: str = "unirl",
        run_name: str | None = None,
        mode: str = "offline",
        entity: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.project, self.run_name, self.mode, self.entity = project, run_name, mode, entity
        self.settings = {"silent": True, "console": "off", "x_disable_stats": True, **(settings or {})}
        self.run = None

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name or os.path.basename(os.path.normpath(os.path.abspath(run_dir))),
            dir=os.path.abspath(run_dir),
            mode=self.mode,
            config=config,
            reinit="create_new",
            settings=wandb.Settings(**self.settings),
        )

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, samples: Samples) -> None:
        text = any("response" in e for e in samples.entries)
        columns = ["prompt", "reward"] + (["response"] if text else [])
        data = [
            [str(e.get("prompt", "")), e.get("reward")] + ([str(e.get("response", ""))] if text else [])
            for e in samples.entries
        ]
        logged: dict[str, Any] = {"samples_table": self.wandb.Table(columns=columns, data=data)}
        if samples.grid is not None:
            caption = " | ".join(str(e.get("prompt", "")) for e in samples.entries)
            logged["samples"] = self.wandb.Image(samples.grid, caption=caption[:1000])
        self.run.log(logged, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (ConsoleTracker, TensorBoardTracker, WandbTracker)}
_ENTRY_HELP = "a tracker name or {name: <name>, optional: <bool>, <options>}"


def _entries(spec: Any) -> tuple[list[tuple[str, str, dict[str, Any], bool]], list[str]]:
    """(key, name, options, optional) of each entry of a `tracking` node, and its problems."""
    if spec is None:
        return [], []
    if not isinstance(spec, (list, tuple)):
        return [], [f"tracking: expected a list of trackers ({_ENTRY_HELP}), got {spec!r}"]
    entries, problems = [], []
    for i, item in enumerate(spec):
        key = f"tracking[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            problems.append(f"{key}: expected {_ENTRY_HELP}, got {item!r}")
            continue
        options = {k: v for k, v in item.items() if k not in ("name", "optional")}
        optional = item.get("optional", False)
        if not isinstance(optional, bool):
            problems.append(f"{key}.optional: expected true or false, got {optional!r}")
            continue
        if item["name"] not in TRACKERS:
            problems.append(
                f"{key}.name: unknown tracker {item['name']!r}; choose from {sorted(TRACKERS)} "
                "(metrics.jsonl is always written)"
            )
            continue
        entries.append((key, item["name"], options, optional))
    names = [name for _, name, _, _ in entries]
    problems += [
        f"tracking: {n!r} is listed {names.count(n)} times; list each tracker once"
        for n in sorted(set(names))
        if names.count(n) > 1
    ]
    return entries, problems


def tracker_problems(spec: Any) -> list[str]:
    """Problems of a recipe's `tracking` node (a plain list): unknown names, malformed entries,
    options a tracker does not take. Starts nothing."""
    entries, problems = _entries(spec)
    for key, name, options, _ in entries:
        try:
            TRACKERS[name](**options)
        except (TypeError, ValueError) as exc:
            problems.append(f"{key} ({name}): {exc}")
    return problems


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The real numbers of a row, `step` left out (bools, strings and nulls are not plotted)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    }


class Tracking:
    """`metrics.jsonl` and the recipe's trackers of one run, on the driver.

    Use `Tracking.start(run_dir, spec, config)`, then `log(row)` per metrics row,
    `log_samples(step, stem)` after the trainer saved a step's samples, and `close()`.
    """

    def __init__(self, jsonl: JsonlWriter, trackers: list[tuple[str, Tracker, bool]]) -> None:
        self.jsonl = jsonl
        self.trackers = trackers  # (key in the recipe, tracker, optional)

    @classmethod
    def start(
        cls, run_dir: str, spec: Any, config: dict[str, Any], metrics_name: str = "metrics.jsonl"
    ) -> Tracking:
        """Open `<run_dir>/<metrics_name>` (appending) and start each tracker of the `tracking`
        node `spec` with the resolved recipe `config`. Raises `TrackerError` naming the first
        required tracker that fails to start (the ones already started are closed)."""
        entries, problems = _entries(spec)
        if problems:
            raise TrackerError("; ".join(problems))
        started: list[tuple[str, Tracker, bool]] = []
        for key, name, options, optional in entries:
            tracker = TRACKERS[name](**options)
            try:
                tracker.start(run_dir, config)
            except Exception as exc:  # noqa: BLE001 - any failure to start is the tracker's, named below
                msg = f"{key}: tracker {name!r} failed to start: {type(exc).__name__}: {exc}"
                if optional:
                    print(f"warning: {msg}; it is optional, so the run goes on without it", file=sys.stderr)
                    continue
                for _, other, _ in started:
                    other.close()
                raise TrackerError(
                    f"{msg}. Install what it needs (pip install -e '.[tracking]'), remove it from "
                    f"`tracking`, or set `optional: true` on it to run without it"
                ) from exc
            started.append((key, tracker, optional))
        return cls(JsonlWriter(os.path.join(run_dir, metrics_name)), started)

    @classmethod
    def from_recipe(cls, run_dir: str, cfg: DictConfig, metrics_name: str = "metrics.jsonl") -> Tracking:
        """`start` with the recipe's `tracking` node and the resolved recipe (less `hydra`)."""
        config = OmegaConf.to_container(cfg, resolve=True)
        config.pop("hydra", None)
        return cls.start(run_dir, config.get("tracking"), config, metrics_name)

    def _each(self, what: str, call) -> None:
        for entry in list(self.trackers):
            key, tracker, optional = entry
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - an optional tracker's failure only removes it
                if not optional:
                    raise TrackerError(f"{key}: tracker {tracker.name!r} failed in {what}: {exc}") from exc
                print(
                    f"warning: {key}: tracker {tracker.name!r} failed in {what} ({type(exc).__name__}: "
                    f"{exc}); it is optional, so the run goes on without it",
                    file=sys.stderr,
                )
                self.trackers.remove(entry)

    def log(self, row: dict[str, Any]) -> None:
        """Append `row` to `metrics.jsonl`, then give its numbers to every tracker at `row["step"]`."""
        self.jsonl.write(row)
        step, scalars = int(row["step"]), _scalars(row)
        self._each("log_scalars", lambda t: t.log_scalars(step, scalars))

    def log_samples(self, step: int, stem: str) -> None:
        """Give the samples saved at `stem` (`<stem>.png` + `.json`, or `.json`) to every tracker."""
        if not self.trackers:
            return
        samples = Samples.read(stem)
        self._each("log_samples", lambda t: t.log_samples(step, samples))

    def close(self) -> None:
        """Close `metrics.jsonl` and every tracker (each is closed even if another fails)."""
        self.jsonl.close()
        trackers, self.trackers = self.trackers, []
        errors = []
        for key, tracker, _ in trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                errors.append(f"{key}: tracker {tracker.name!r} failed to close: {exc}")
        if errors:
            print("warning: " + "; ".join(errors), file=sys.stderr)
