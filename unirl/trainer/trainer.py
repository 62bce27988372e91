"""`Trainer`: the driver of every RL run (single controller on Ray), a walk over a graph of tracks.

A recipe is a chain of tracks (`unirl.trainer.graph.RunGraph`): a single-track recipe is a
chain of one; a composed one a chain whose tracks each have their own model (a prompt
enhancer feeding a diffusion model); a unified one a chain whose tracks share one backbone
(Janus's plan and image segments). Per step: prompts -> rollout, root first (each engine
unit samples its track, or a shared backbone's tracks, where the recipe says: the train
workers' own module or dedicated engines synced to this step's weights; a child's request is
built from its parent's texts) -> rewards, leaf first (a leaf by its reward, a parent by the
aggregate of its children's plus its own) -> advantages per trained track -> train per trained
track (a shared backbone's tracks in one joint step) -> [checkpoint]; the step's partitions are
cleared in a ``finally``. The driver holds metas, ids, media for scoring, rewards and
advantages; the trainer owns placement, worker construction, the transport, phase order,
checkpoints and resume.

What differs per modality (building a rollout request, the fields scoring fetches, how samples
are kept and evaluated) is a `unirl.trainer.modality` object chosen by a track's sampling
params. A single-track run's one track is its own root and leaf, so its reward is scored
chunk by chunk while the rest of the rollout generates, and it alone may sample dynamically
(DAPO) or ahead of the weights it trains (`rollout.max_staleness: k`, `AheadRollout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from unirl.algorithms.advantages import track_advantages
from unirl.dataplane import BatchMeta, get_batch, make_transport
from unirl.distributed.cores import apply_thread_count, governed_threads, usable_cores
from unirl.distributed.group import DevicePool, WorkerError, in_process, placement, remote
from unirl.distributed.group.cluster import init_ray
from unirl.reward.service import RewardError, RewardService
from unirl.tracking.gallery import write_gallery
from unirl.tracking.metrics import save_image_grid
from unirl.tracking.trackers import Tracking
from unirl.train.sequence_parallel import sequence_parallel_degree
from unirl.train.stack import reduce_metrics
from unirl.trainer.checkpoints import (
    checkpoint_dir,
    mark_complete,
    read_driver_state,
    resolve_resume_path,
    saves_base_model,
    write_driver_state,
)
from unirl.trainer.engine_worker import EngineWorker
from unirl.trainer.engines import DedicatedRollouts, InFlightRollout, PartialRollout, TrainsideRollouts
from unirl.trainer.evaluation import Evaluator
from unirl.trainer.graph import LINEAGE_FIELDS, PARENT_FIELDS, RunGraph, aggregate_children, track_recipe
from unirl.trainer.modality import ImageModality, TextModality, modality_for
from unirl.trainer.step_record import StepRecord
from unirl.trainer.unified import UnifiedEngineWorker
from unirl.trainer.worker import RLWorker, build
from unirl.types.lineage import child_request
from unirl.types.rollout_resp import RolloutTrack

# exported in every worker. THP_MEM_ALLOC_ENABLE: PyTorch's CPU allocator backs large allocations
# with transparent huge pages, so a fresh tensor (a fetched rollout, a sampled trajectory) takes
# 512x fewer page faults (benchmarks/README.md: a 512 MiB fetch ~3x faster).
WORKER_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def warn_if_niced(processes: list[dict[str, Any]]) -> None:
    """Warn on stderr when a worker or engine process runs above niceness 0 (a Ray cluster started
    without ``RAY_worker_niceness=0``): beside any other busy process it gets a sliver of the
    core they share."""
    niced = [p for p in processes if p.get("niceness", 0) > 0]
    if niced:
        print(
            f"warning: {len(niced)} of the run's {len(processes)} worker/engine processes run at niceness "
            f"{max(p['niceness'] for p in niced)} (Ray's default for workers): beside any other busy "
            "process they get a sliver of a shared core, and a step can slow many-fold; start the "
            "cluster with RAY_worker_niceness=0 in `ray start`'s environment "
            "(examples/run_experiment_multinode.sh does; docs/results/contention.md)",
            file=sys.stderr,
        )


class TrainingError(RuntimeError):
    """A run stopped: names the step, the failing worker and the last checkpoint."""


def labelled(what: str, name: str | None) -> str:
    """A phase's name in errors: `what`, or `what (<track>)` for a named track or engine."""
    return what if name is None else f"{what} ({name})"


@dataclasses.dataclass
class AheadRollout:
    """A later step's rollout, submitted while an earlier step trains (`rollout.max_staleness`):
    its step, the rollout in flight (`flight.version`: the weights it samples) and the data
    source's position before its prompts."""

    step: int
    flight: InFlightRollout | PartialRollout
    source_state: dict[str, Any]


def partial_rollout_rows(stats: dict[str, Any], step: int) -> dict[str, float]:
    """A partial rollout's row entries: how many versions behind step `step` its tokens were
    sampled (mean over tokens, and the freshest), and the share of samples resumed across a sync."""
    counts = stats["tokens_by_version"]
    total = sum(counts.values())
    return {
        "rollout/token_staleness_mean": sum((step - v) * n for v, n in counts.items()) / max(total, 1),
        "rollout/token_staleness_min": float(step - max(counts)) if counts else 0.0,
        "rollout/resumed_frac": stats["resumed"] / max(stats["samples"], 1),
    }


class Trainer:
    """Runs the recipe `cfg` (already validated) up to `cfg.num_steps`.

    Writes into `cfg.output_dir`: `config.yaml` (resolved), `metrics.jsonl`
    (one row per step; with `eval`, a step-0 row and `eval/...` keys every
    `eval.every_n_steps` steps and at the end), `samples/step_XXXX.png` (+ .json prompts and
    rewards; a text run writes only the .json, with the responses; a chain's leaf images are
    captioned "user prompt -> rewrite" beside `samples/lineage_step_XXXX.json`: user prompt ->
    rewrites -> image rewards) every `logging.save_images_every` steps and at the last step (0: none),
    `gallery.html` (self-contained: sample grids, prompts, reward and accuracy curves),
    what the trackers the recipe's `tracking` lists write (rows, samples and the resolved
    recipe; `unirl/tracking/README.md`), `base_model/` for a tiny model,
    `checkpoints/step_XXXXXX/` every `checkpoint.every_n_steps` steps, and `checkpoints/final/`
    (weights that the model config's `load_checkpoint` loads back; with `train.ema`, the EMA
    weights in the same format in `checkpoints/final_ema/`). A composed run (a model per track)
    has a directory per track under each (`base_model/<track>`, `checkpoints/.../<track>`; a
    frozen track's final directory is its whole bundle). With `resume_from` (a checkpoint
    directory or `latest`) it continues from that step and the run is identical to one that
    never stopped. Rows prefix a named track's metrics with `<track>/`; `reward/mean` is the
    leaf's.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = str(cfg.output_dir)
        self.graph = RunGraph.of(cfg)
        self.data_source = build(cfg.data_source)
        # the driver asks a single track's algorithm only for its dynamic-sampling hook
        self.algorithm = build(cfg.algorithm) if self.graph.single else None
        self.num_steps = int(cfg.num_steps)
        self.engines: dict[str | None, TrainsideRollouts | DedicatedRollouts] = {}  # per engine unit
        self.modalities: dict[str | None, Any] = {}
        ckpt = cfg.get("checkpoint") or {}
        self.every_n = int(ckpt.get("every_n_steps", 0) or 0)
        self.base_model = self._base_models()
        self.last_checkpoint: str | None = None
        self.step_stats: dict[str, float] = {}  # weight-sync figures of the step, for its row
        self.ahead: list[AheadRollout] = []  # later steps' rollouts, in flight while this one trains
        self.resume_ahead: tuple[int, int] | None = None  # (first, last) step a checkpoint had in flight
        self.resume_partial: tuple[str, dict[int, int]] | None = None  # (checkpoint, start version by step)
        self.restore_s: float | None = None
        self.max_seconds = cfg.get("max_seconds")  # one invocation's wall clock (None: none)
        self.stopped_at: int | None = None  # the step a `max_seconds` stop checkpointed, else None
        self.transport = make_transport(cfg.transport)
        if self.graph.shared:
            self.engine_class = UnifiedEngineWorker
        ev = cfg.get("eval")
        self.eval_every = int(ev.get("every_n_steps", 0) or 0) if ev else 0
        self.evaluator = self._evaluator(ev) if ev else None

    worker_class: type = RLWorker  # a train rank, of every kind of run
    # a dedicated engine's actor (a shared backbone's: `UnifiedEngineWorker`)
    engine_class: type = EngineWorker

    def _evaluator(self, ev: DictConfig) -> Evaluator:
        """The run's evaluation: a single track's of its policy, or a chain's of prompt -> rewrite
        -> image (its leaf's evaluation sampling over the leaf's own; a shared backbone's as given)."""
        if self.graph.single:
            return Evaluator.from_config(ev)
        leaf = self.graph.leaf
        return Evaluator.from_config(
            ev, leaf, None if self.graph.shared else self.graph.tracks[leaf].sampling
        )

    def _base_models(self) -> str | dict[str, str]:
        """The directory exports load onto: the model's `pretrained_path`, or where a tiny model's
        untrained bundle is written (`base_model/`); a composed run's per track (`base_model/<track>`)."""

        def base(model: Any, sub: str) -> str:
            path = model.get("pretrained_path")
            return os.path.abspath(str(path) if path else os.path.join(self.out, sub))

        if self.graph.per_track_models:
            return {
                n: base(self.cfg.tracks[n].model, os.path.join("base_model", n)) for n in self.graph.order
            }
        return base(self.cfg.model, "base_model")

    def run(self) -> list[dict[str, Any]]:
        """Run the loop; returns the metric rows written by this invocation."""
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(self.cfg, resolve=True))
        resume = resolve_resume_path(self.cfg)
        with governed_threads(), self._workers() as group:
            start = 0
            if resume is not None:
                t0 = time.perf_counter()
                start = self._restore(group, resume)
                self.restore_s = time.perf_counter() - t0
            rows = self._loop(group, start)
            if self.stopped_at is None:
                self._export(group)
            return rows

    @contextlib.contextmanager
    def _workers(self) -> Iterator[Any]:
        """The run's processes, up for the `with` block and torn down after it whatever happens:
        Ray (started here unless already running or joined), the device pool, the transport, the
        worker group (in this process with `launcher: in_process`) and the rollout engines
        (`self.engines`); writes `placement.json`. Yields the worker group."""
        local = self.cfg.get("launcher", "ray") == "in_process"
        devices = self.graph.pool_devices(int(self.cfg.num_devices))
        started_ray = False if local else init_ray(num_cpus=max(2 * devices, usable_cores()))
        pool = None if local else DevicePool(devices)
        group = None
        try:
            transport_info = self.transport.start()
            plain = OmegaConf.to_container(self.cfg, resolve=True)
            plain.pop("hydra", None)
            args = self._worker_args(plain, transport_info)
            if local:  # one worker in this process, no Ray (validated: 1 device, inband transport)
                group = in_process(self.worker_class, *args)
                layout = {"num_devices": 1, "num_nodes": 1, "bundle_node_ids": []}
            else:
                where = placement(pool, int(self.cfg.num_devices))
                group = remote(self.worker_class, where, *args, env=WORKER_ENV)
                group.data_group_size = sequence_parallel_degree(self.cfg)
                layout = {
                    "num_devices": pool.num_devices,
                    "num_nodes": pool.num_nodes,
                    "bundle_node_ids": pool.bundle_node_ids(),
                }
            processes = {
                "workers": self._call(group, "process_info", 0),
                "engines": self._start_engines(plain, pool, group, transport_info),
            }
            with open(os.path.join(self.out, "placement.json"), "w") as f:
                json.dump(
                    {**layout, "ranks": [dataclasses.asdict(r) for r in group.rank_infos], **processes},
                    f,
                    indent=2,
                )
            warn_if_niced(processes["workers"] + processes["engines"])
            yield group
        finally:
            self._stop_engines()
            if group is not None:
                try:
                    group.teardown()
                except WorkerError:
                    pass  # a dead worker has no process group left to tear down
                group.shutdown()
            self.transport.close()
            if pool is not None:
                pool.shutdown()
            if started_ray:
                import ray

                ray.shutdown()

    def _start_engines(
        self, plain: dict[str, Any], pool: Any, group: Any, transport_info: dict[str, Any]
    ) -> list:
        """Set `self.engines`: per engine unit, the train workers (trainside) or dedicated engines
        fed by weight sync, built from the recipe (a composed track's from its view of it,
        `track_recipe`); separate engines take the pool's devices after the training ones, unit
        after unit. Returns the engines' `process_info` for placement.json."""
        processes: list[dict[str, Any]] = []
        first = int(self.cfg.num_devices)
        for unit in self.graph.units:
            settings = unit.settings
            if not settings.dedicated:
                self.engines[unit.key] = TrainsideRollouts(group, unit.key)
                continue
            view = plain if unit.key is None else track_recipe(plain, unit.key)
            engines = self._guard(
                0,
                labelled("engine setup", unit.key),
                DedicatedRollouts,
                settings,
                view,
                pool,
                group,
                transport_info,
                WORKER_ENV,
                self.engine_class,
                unit.key,
                first,
            )
            self.engines[unit.key] = engines
            first += settings.num_engines if settings.placement == "separate" else 0
            info = self._guard(0, "process_info", engines.process_info)
            processes += info if unit.key is None else [{**p, "track": unit.key} for p in info]
        return processes

    def _stop_engines(self) -> None:
        """Shut down what `_start_engines` started (whatever state the run is in)."""
        for engines in self.engines.values():
            engines.shutdown()
        self.engines = {}

    def _worker_args(self, plain: dict[str, Any], transport_info: dict[str, Any]) -> tuple:
        """Arguments of every worker after its `RankInfo`: the resolved recipe, the optimizer
        steps of the run, where rank 0 writes a tiny model's untrained bundle (None: nowhere) and
        the transport's info; a composed run's steps and bundles per track."""
        save_base = saves_base_model(self.cfg)

        def updates(train: Any) -> int:
            return self.num_steps * build(train.stack).steps_per_rollout

        def base(model: Any, path: str) -> str | None:
            return None if model.get("pretrained_path") or not save_base else path

        if self.graph.per_track_models:
            tracks = self.cfg.tracks
            steps = {n: updates(tracks[n].train) for n in self.graph.trained}
            bases = {n: base(tracks[n].model, self.base_model[n]) for n in self.graph.order}
            return (plain, steps, bases, transport_info)
        return (plain, updates(self.cfg.train), base(self.cfg.model, self.base_model), transport_info)

    def _export(self, group) -> None:
        """Write `checkpoints/final/` (and `final_ema/` with a one-model run's `train.ema`) after
        the last step, and with `export_dir` the whole trained model there (`export_bundle` of the
        model config's `load_checkpoint` of `final`)."""
        final = os.path.join(self.out, "checkpoints", "final")
        self._call(group, "save_weights", self.num_steps - 1, final, self.base_model)
        if not self.graph.per_track_models and self.cfg.train.get("ema"):
            self._call(group, "save_weights", self.num_steps - 1, final + "_ema", self.base_model, True)
        if self.cfg.get("export_dir"):  # a single-track recipe's whole model, in its library's layout
            from unirl.models.source import DTYPES
            from unirl.models.weights import export_bundle

            bundle = build(self.cfg.model).load_checkpoint(final)
            export_bundle(bundle, str(self.cfg.export_dir), DTYPES[self.cfg.get("export_dtype", "float16")])

    def _call(self, group, method: str, step: int, *args: Any) -> Any:
        """Call a worker-group method; a worker failure becomes a `TrainingError` naming the step."""
        return self._guard(step, method, getattr(group, method), *args)

    def _guard(self, step: int, what: str, fn, *args: Any) -> Any:
        """`fn(*args)`; a worker or engine failure (`WorkerError`) becomes a `TrainingError`
        naming the step, the phase, the worker (a dedicated engine by its index) and the last
        complete checkpoint."""
        try:
            return fn(*args)
        except WorkerError as exc:
            last = self.last_checkpoint or "none written"
            who = f"rollout engine {exc.rank} failed: " if exc.worker_cls.endswith("EngineWorker") else ""
            raise TrainingError(
                f"run stopped at step {step + 1} during '{what}': {who}{exc}. Last complete checkpoint: {last}"
            ) from exc

    @staticmethod
    def _release_kept(group, partition: str) -> None:
        """Drop the workers' graphs kept for `partition` (`rollout.keep_graph`); a dead worker holds none."""
        try:
            group.release_kept(partition)
        except WorkerError:
            pass

    def _driver_phase(self, step: int, phase: str, fn, *args: Any) -> Any:
        """Run a driver-side phase; its error (a NaN reward naming the sample, a scorer's data
        error, an advantage that cannot be computed) stops the run as a `TrainingError` naming
        the step, before anything of the step is trained."""
        try:
            return fn(*args)
        except (RewardError, ValueError) as exc:
            last = self.last_checkpoint or "none written"
            raise TrainingError(
                f"run stopped at step {step + 1} during '{phase}' (nothing of this step was trained): "
                f"{type(exc).__name__}: {exc}. Last complete checkpoint: {last}"
            ) from exc

    # ---------------------------------------------------------------- checkpoints

    def _restore(self, group, path: str) -> int:
        state = read_driver_state(path)
        self._call(group, "load_checkpoint", state["step"], path)
        self.data_source.load_state_dict(state["data_source"])
        behind = state.get("engine_weights_version")
        root = self.graph.units[0]
        if behind is not None and root.settings.max_staleness:
            # the checkpoint was taken with later steps' rollouts in flight: the engines get the weights
            # they sampled, and the resumed run samples those rollouts again from them (`_loop`)
            self._guard(
                state["step"], "restore engine weights", self.engines[root.key].load_weights, path, behind
            )
            if root.settings.partial_tokens:  # partial rollouts: their drafts are in the checkpoint
                self.resume_partial = (path, {int(k): v for k, v in state["partial_versions"].items()})
            else:
                self.resume_ahead = (int(state["step"]), int(state.get("ahead_until", state["step"])))
        self.last_checkpoint = path
        metrics = os.path.join(self.out, "metrics.jsonl")
        if os.path.exists(metrics):  # drop rows a stopped run wrote after its last checkpoint
            with open(metrics) as f:
                kept = [line for line in f if json.loads(line)["step"] <= state["step"]]
            with open(metrics, "w") as f:
                f.writelines(kept)
        return int(state["step"])

    def _save_checkpoint(self, group, step: int) -> None:
        """Write the workers' state and the driver's. With later steps' rollouts in flight
        (`self.ahead`, max_staleness >= 1) the checkpoint also holds the weights they sample (the
        engines', one version for all of them, behind the trainer's), the last step in flight and
        the data source's position before the first one's prompts, so a resumed run samples them
        again identically. Partial rollouts (`rollout.partial_tokens`) in flight are saved as they
        are (each engine's drafts: tokens, log-probs, versions, generators) with the weights the
        engines hold, and resume from there."""
        path = checkpoint_dir(self.out, step)
        t0 = time.perf_counter()
        self._call(group, "save_checkpoint", step - 1, path, self.base_model)
        source, extra = self.data_source.state_dict(), {}
        if self.ahead and self.graph.units[0].settings.partial_tokens:
            engines = self.engines[self.graph.root]
            self._guard(step - 1, "save engine weights", engines.save_weights, path)
            self._guard(step - 1, "save partial rollouts", engines.save_drafts, path)
            extra = {
                "engine_weights_version": engines.version,
                "partial_versions": {str(a.step): a.flight.version for a in self.ahead},
            }
        elif self.ahead:
            self._guard(step - 1, "save engine weights", self.engines[self.graph.root].save_weights, path)
            source = self.ahead[0].source_state
            extra = {
                "engine_weights_version": self.ahead[0].flight.version,
                "ahead_until": self.ahead[-1].step,
            }
        write_driver_state(path, step, source, self.cfg, save_s=time.perf_counter() - t0, extra=extra)
        mark_complete(path)
        self.last_checkpoint = path

    # ---------------------------------------------------------------- evaluation and samples

    def _evaluate(self, group, step: int, references: bool = False) -> dict[str, float]:
        """`eval/...` on the held-out prompts (`Evaluator`), sampled deterministically on the
        workers (from every trained track's EMA weights with `eval.use_ema`); with `references`, a
        chain's floor and ceiling too (the user prompt and the canonical prompt fed straight to the
        image model)."""
        world = int(self.cfg.num_devices)
        if self.graph.single:
            world //= sequence_parallel_degree(self.cfg)  # sample shards
        ev = self.evaluator

        def pad(req):  # with copies of the last sample, so every rank gets the same count
            n = len(req)
            return req.select(list(range(n)) + [n - 1] * (world - n % world)) if n % world else req

        def sample(req, samplings=None, feed="rewrite"):
            n = len(req)
            parts = self._call(group, "sample_eval", step, pad(req), samplings, feed, ev.use_ema)
            if ev.chain is None:  # a single track's images, or texts: one list per rank
                flat = [t for part in parts for t in part] if isinstance(parts, list) else parts
                return flat[:n]
            texts = [t for p in parts for t in p["texts"]][:n]
            per = len(parts[0]["images"]) // len(parts[0]["texts"])
            return texts, torch.cat([p["images"] for p in parts])[: n * per]

        metrics = ev.run(sample, self.modalities.get(None), references)
        return {f"eval/{k}": v for k, v in metrics.items()}

    def _save_samples(self, views: dict[str | None, RolloutTrack], stem: str) -> None:
        """A single track's samples as its modality keeps them; a chain's leaf images as `<stem>.png`
        (+ `.json`), each captioned "user prompt -> rewrite" with its reward, and
        `lineage_<name>.json` beside it: per user prompt, its rewrites with their rewards and, per
        rewrite, the rewards of its images."""
        if self.graph.single:
            self.modalities[None].save_samples(views[None], stem)
            return
        leaf, root = views[self.graph.leaf], views[self.graph.root]
        key = self.graph.prompt_key
        captions = [f"{m.get(key, '?')} -> {p}" for m, p in zip(leaf.metadata, leaf.prompts, strict=True)]
        save_image_grid(leaf.media, stem + ".png", captions, leaf.rewards.tolist())
        children: dict[str, list[float]] = {}
        for pid, r in zip(leaf.parent_ids, leaf.rewards.tolist(), strict=True):
            children.setdefault(pid, []).append(r)
        tree: dict[str, dict[str, Any]] = {}
        for i, sid in enumerate(root.sample_ids):
            entry = tree.setdefault(root.group_ids[i], {"user_prompt": root.prompts[i], "rewrites": []})
            entry["rewrites"].append(
                {
                    "rewrite": root.texts[i],
                    "reward": float(root.rewards[i]),
                    "image_rewards": children.get(sid, []),
                }
            )
        head, tail = os.path.split(stem)
        with open(os.path.join(head, f"lineage_{tail}.json"), "w") as f:
            json.dump(list(tree.values()), f, indent=1)

    # ---------------------------------------------------------------- one step

    def _rollout_and_score(
        self, group, step: int, partition: str, row: dict[str, Any], ahead: InFlightRollout | None
    ):
        """A single-track run's rollout: draw prompts, roll out, fetch what scoring needs and
        score; returns the train batch's (meta, scored track, time the first rollout ended) and
        adds the reward metrics to `row`.

        The rollout runs where the recipe says (the train workers, or dedicated engines synced
        to this step's weights first); each finished chunk is scored while the rest generates.
        `ahead`: this step's rollout, submitted during an earlier step (`rollout.max_staleness`);
        its engines then keep their weights for any extra generation, and `rollout/staleness` says
        how many versions behind they sampled.

        With an algorithm that samples dynamically (`dynamic_sampling_limit()` not None: DAPO),
        the groups its `keep_groups` drops (DAPO: those whose rewards are all equal) are dropped
        and more prompts are rolled out into the same partition until `prompts_per_rollout`
        groups with signal are kept (the first ones, in order), at most `max_num_gen_batches`
        generations. The row's reward metrics are the first generation's (the policy's reward as
        sampled); `dynamic/...` counts the rest.
        """
        track, modality, engines = self.graph.tracks[None], self.modalities[None], self.engines[None]
        settings = self.graph.units[0].settings
        prompts = int(self.cfg.prompts_per_rollout)
        limit = self.algorithm.dynamic_sampling_limit()
        dynamic = limit is not None
        metas, tracks, kept, t_first = [], [], [], None
        max_batches = limit if dynamic else 1
        stale = settings.max_staleness > 0 and engines.version is not None

        def score(chunk: RolloutTrack) -> None:
            if track.reward is None:  # a supervised track: its demonstrations carry no reward
                chunk.rewards = torch.zeros(len(chunk))
                return
            self._driver_phase(step, "reward", track.reward.score_and_attach, chunk)

        for k in range(max_batches):
            if k == 0 and ahead is not None:
                flight = ahead
            else:
                # extra generations get rollout ids past every step's own, so their seeds and ids are new
                req = modality.request(self.data_source.next_batch(prompts), step + k * self.num_steps)
                if not stale:
                    self.step_stats.update(self._guard(step, "weight sync", engines.prepare, step))
                flight = self._guard(step, "rollout", engines.submit, req, partition)
            fields = track.score_fields(modality.reward_fields)
            meta, view, t_done = self._guard(step, "rollout", flight.collect, self.transport, fields, score)
            t_first = t_first or t_done
            if k == 0:
                if track.reward is not None:
                    row.update(track.reward.metrics(view))
                if settings.dedicated:
                    row["rollout/staleness"] = step - flight.version
                if getattr(flight, "stats", None):  # a partial rollout: the versions its tokens came from
                    row.update(partial_rollout_rows(flight.stats, step))
            offset = sum(len(m) for m in metas)
            metas.append(meta)
            tracks.append(view)
            if not dynamic:
                return meta, view, t_first
            kept += [offset + i for i in self.algorithm.keep_groups(view.rewards, view.group_ids)]
            if len(kept) >= prompts * modality.sampling.samples_per_prompt:
                break
        need = prompts * modality.sampling.samples_per_prompt
        row.update(
            {
                "dynamic/gen_batches": k + 1,
                "dynamic/kept_groups": len(kept) // modality.sampling.samples_per_prompt,
            }
        )
        if len(kept) < need:
            raise TrainingError(
                f"step {step + 1}: dynamic sampling kept {len(kept) // modality.sampling.samples_per_prompt} groups "
                f"with unequal rewards after algorithm.config.max_num_gen_batches={max_batches} generations, "
                f"{prompts} needed (prompts_per_rollout); the reward gives (almost) every group one value: "
                "check it, or raise max_num_gen_batches"
            )
        kept = kept[:need]
        return BatchMeta.concat(metas).select(kept), RolloutTrack.concat(tracks).select(kept), t_first

    def _walk(self, group, step: int, partition: str, row: dict[str, Any]) -> dict[str, BatchMeta]:
        """A chain's rollout, root first from the step's prompts: each engine unit's request
        (after the root's, `child_request` of its parent's texts, fetched from the transport) is
        sampled where the unit says (the train workers' own module, split over the ranks; or its
        dedicated engines: synced to this step's weights first, asleep again before the next
        unit wakes) into its tracks' partitions. Returns the metas by track; adds each engine's
        sync figures (`<track>/sync/...`, `<track>/time/sync_s`) to `row`."""
        graph = self.graph
        examples = self.data_source.next_batch(int(self.cfg.prompts_per_rollout))
        req = self.modalities[graph.root].request(examples, step)
        metas: dict[str, BatchMeta] = {}
        for i, unit in enumerate(graph.units):
            first = unit.tracks[0]
            depth = graph.order.index(first)
            if depth:
                fields = PARENT_FIELDS + (["root_ids"] if depth > 1 else [])
                view = get_batch(self.transport, metas[graph.order[depth - 1]], fields)
                sigmas = getattr(self.modalities[first], "sigmas", None)
                req = child_request(
                    view, view.texts, graph.tracks[first].sampling, sigmas, step, graph.prompt_key
                )
            engines = self.engines[unit.key]
            where = partition if unit.key is None else graph.tracks[unit.key].partition(partition)
            if unit.settings.dedicated:
                stats = self._guard(step, labelled("weight sync", unit.key), engines.prepare, step)
                row.update({unit.prefix + k: v for k, v in stats.items()})
            flight = self._guard(step, labelled("rollout", unit.key), engines.submit, req, where)
            got = self._guard(step, labelled("rollout", unit.key), flight.wait)
            metas.update(got if isinstance(got, dict) else {first: got})
            if i + 1 < len(graph.units):  # colocated engines free the devices for the next unit's
                self._guard(step, labelled("sleep", unit.key), engines.release)
        return metas

    def _fields(self, name: str) -> list[str]:
        """What scoring fetches of a chain's track: its modality's reward fields (a critic's values
        for GAE), and a child's lineage."""
        track = self.graph.tracks[name]
        modality = TextModality if track.text else ImageModality
        return track.score_fields(modality.reward_fields) + (
            LINEAGE_FIELDS if name != self.graph.root else []
        )

    def _score(self, step: int, metas: dict[str, BatchMeta], row: dict[str, Any]) -> dict[str, RolloutTrack]:
        """Fetch what scoring needs of every track of a chain and set its rewards, leaf first: the
        leaf by its reward, each parent by the aggregate of its children's rewards (+ its own)."""
        views: dict[str, RolloutTrack] = {}
        child = None
        for name in reversed(self.graph.order):
            track = self.graph.tracks[name]
            view = get_batch(self.transport, metas[name], self._fields(name))
            own = None
            if track.reward is not None:
                self._driver_phase(step, f"reward ({name})", track.reward.score_and_attach, view)
                own = view.rewards
                row.update({f"{name}/{k}": v for k, v in RewardService.metrics(view).items()})
            if child is not None:
                how = track.aggregate
                agg = self._driver_phase(step, f"reward ({name})", aggregate_children, view, child, how)
                view.reward_components = {**view.reward_components, f"children_{how}": agg}
                view.reward_weights = {**view.reward_weights, f"children_{how}": 1.0}
                view.rewards = agg if own is None else agg + own
                row[f"{name}/reward/children_{how}/mean"] = agg.mean().item()
                row[f"{name}/reward/mean"] = view.rewards.mean().item()
                row[f"{name}/reward/std"] = view.rewards.std(unbiased=False).item()
            if view.metadata and "plan_truncated" in view.metadata[0]:  # a plan cut at its token budget
                row[f"{name}/truncated_fraction"] = sum(
                    bool(m["plan_truncated"]) for m in view.metadata
                ) / len(view)
            views[name] = view
            child = view
        row["reward/mean"] = row[f"{self.graph.leaf}/reward/mean"]
        return views

    def _train(self, group, step: int, metas: dict, views: dict, row: dict[str, Any]) -> None:
        """Each trained track's shard trains on the workers (a shared backbone's tracks in one
        joint step); their metrics go into `row`, a named track's under `<track>/`."""
        progress = step / self.num_steps
        trained = self.graph.trained
        if self.graph.shared:
            shards = {n: self.transport.claim(metas[n], "train") for n in trained}
            rewards = {n: views[n].rewards for n in trained}
            advantages = {n: views[n].advantages for n in trained}
            metrics = self._call(group, "train_joint", step, shards, rewards, advantages, progress)
            row.update(reduce_metrics(metrics))
            return
        for name in trained:
            shard, view = self.transport.claim(metas[name], "train"), views[name]
            named = () if name is None else (name,)
            metrics = self._call(group, "train", step, shard, view.rewards, view.advantages, progress, *named)
            prefix = self.graph.tracks[name].prefix
            row.update({prefix + k: v for k, v in reduce_metrics(metrics).items()})

    def _step(self, group, step: int, partition: str, record: StepRecord) -> dict[str | None, RolloutTrack]:
        """Rollout, rewards, advantages and training of one step, marked on `record`; returns the
        scored views of every track."""
        row = record.row
        ahead = self.ahead.pop(0).flight if self.ahead else None
        if self.graph.single:
            meta, view, t_rollout = self._rollout_and_score(group, step, partition, row, ahead)
            record.mark("rollout", t_rollout)
            metas, views = {None: meta}, {None: view}
        else:
            metas = self._walk(group, step, partition, row)
            record.mark("rollout")
            views = self._score(step, metas, row)
        for name in self.graph.trained:
            track = self.graph.tracks[name]
            if track.advantage is None:  # a supervised track: nothing to weigh its samples by
                views[name].advantages = torch.zeros(len(views[name]))
            else:
                what = labelled("advantages", name)
                self._driver_phase(step, what, track_advantages, views[name], track.advantage)
        record.mark("reward")
        last = self.graph.units[-1]
        self._guard(
            step, labelled("sleep", last.key), self.engines[last.key].release
        )  # colocated engines free the devices
        settings = self.graph.units[0].settings
        if settings.partial_tokens and step + 1 < self.num_steps:
            self._advance_partials(step)
        elif settings.max_staleness and not self.ahead and step + 1 < self.num_steps:
            self.ahead = self._submit_ahead(step)
        record.mark("train")
        self._train(group, step, metas, views, row)
        record.mark("trained")
        return views

    def _engine_rows(self, step: int, record: StepRecord) -> None:
        """Per dedicated engine unit (a named one under `<track>/`): its largest resident memory
        (after sleep when colocated) and the first update's ratio as `off_policy/ratio_mean`; the
        last unit's release (sleep, and the weight sync of an ahead rollout) as
        `time/engine_release_s`."""
        row = record.row
        for unit in self.graph.units:
            if not unit.settings.dedicated:
                continue
            prefix = unit.prefix
            if f"{prefix}ratio/first_update_mean" in row:
                row[f"{prefix}off_policy/ratio_mean"] = row[f"{prefix}ratio/first_update_mean"]
            engines = self._guard(step, labelled("memory_mb", unit.key), self.engines[unit.key].memory_mb)
            row[f"{prefix}memory/engine_rss_mb"] = max(e["rss"] for e in engines)
        if self.graph.units[-1].settings.dedicated:
            row["time/engine_release_s"] = record.marks["train"] - record.marks["reward"]

    def _loop(self, group, start: int) -> list[dict[str, Any]]:
        infos = self._call(group, "model_info", start)
        infos = {None: infos} if self.graph.single else infos
        graph = self.graph
        # a shared backbone's tracks after its root get their requests from its engine, not the driver
        self.modalities = {
            n: modality_for(t.sampling, infos[n])
            for n, t in graph.tracks.items()
            if n == graph.root or not graph.shared
        }
        if (
            self.resume_ahead is not None
        ):  # the checkpoint's rollouts in flight, from the weights they sampled
            self.ahead = self._submit_steps(*self.resume_ahead)
        if self.resume_partial is not None:  # the checkpoint's partial rollouts, where they were
            path, versions = self.resume_partial
            flights = self._guard(
                start, "restore partial rollouts", self.engines[None].load_drafts, path, versions
            )
            self.ahead = [AheadRollout(int(f.partition.removeprefix("step_")), f, {}) for f in flights]
        log_cfg = self.cfg.get("logging") or {}
        every = int(log_cfg.get("save_images_every", 10))
        tracking = Tracking.from_recipe(self.out, self.cfg)
        rows = []
        if self.eval_every and start == 0:
            row0 = {"step": 0, **self._evaluate(group, 0, references=True)}
            tracking.log(row0)
            rows.append(row0)
        bar = tqdm(
            range(start, self.num_steps),
            initial=start,
            total=self.num_steps,
            desc="train",
            disable=not log_cfg.get("progress", True),
        )
        started = time.perf_counter()
        try:
            for step in bar:
                apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
                record = StepRecord(step)
                row = record.row
                partition = f"step_{step}"
                trained = False
                try:
                    views = self._step(group, step, partition, record)
                    trained = True
                finally:  # a failed step leaks nothing: its partitions and kept graphs go either way
                    for track in graph.tracks.values():
                        self.transport.clear(track.partition(partition))
                    if (
                        self.graph.keep_graph and not trained
                    ):  # graphs kept by rollout for a train that never ran
                        self._release_kept(group, partition)
                engine_stats = [
                    s for e in self.engines.values() for s in self._guard(step, "dataplane_stats", e.stats)
                ]
                dataplane = (
                    self._call(group, "dataplane_stats", step) + engine_stats + [self.transport.stats.drain()]
                )
                record.add_resources(dataplane, self._call(group, "peak_memory_mb", step))
                row.update(self.step_stats)
                self.step_stats = {}
                self._engine_rows(step, record)
                record.add_timings()
                if self.eval_every and ((step + 1) % self.eval_every == 0 or step + 1 == self.num_steps):
                    row.update(self._evaluate(group, step))
                if self.restore_s is not None and step == start:
                    row["time/restore_s"] = self.restore_s
                tracking.log(row)
                rows.append(row)
                saved = bool(self.every_n) and (step + 1) % self.every_n == 0
                if saved:
                    self._save_checkpoint(group, step + 1)
                if self._out_of_time(started) and step + 1 < self.num_steps:
                    if not saved:
                        self._save_checkpoint(group, step + 1)
                    self.stopped_at = step + 1
                    print(
                        f"max_seconds={self.max_seconds} reached after step {step + 1} of {self.num_steps}: "
                        f"checkpoint {self.last_checkpoint}; resume with resume_from=latest",
                        file=sys.stderr,
                    )
                postfix = {"reward": f"{row.get('reward/mean', float('nan')):.4f}"}
                if "loss" in row:  # none while a critic warms up alone, nor in a chain's row
                    postfix["loss"] = f"{row['loss']:.2e}"
                bar.set_postfix(postfix)
                if every > 0 and ((step + 1) % every == 0 or step + 1 == self.num_steps):
                    stem = os.path.join(self.out, "samples", f"step_{step + 1:04d}")
                    self._save_samples(views, stem)
                    write_gallery(self.out)
                    tracking.log_samples(step + 1, stem)
                if self.stopped_at is not None:
                    break
        finally:
            tracking.close()
            for ahead in self.ahead:  # a failed step leaves later steps' rollouts: drop what they put
                self.transport.clear(f"step_{ahead.step}")
        return rows

    def _out_of_time(self, started: float) -> bool:
        """`max_seconds` has passed since this invocation's loop started."""
        return self.max_seconds is not None and time.perf_counter() - started >= float(self.max_seconds)

    def _submit_ahead(self, step: int) -> list[AheadRollout]:
        """Sync this step's weights into a single track's engines and start the rollouts of the
        next `max_staleness` steps on them (as many as the run has left), to run while this step
        and the next ones train: step n + j's samples are j weight versions behind when trained.
        The engines sync again only once all of them were collected, when they are idle."""
        engines = self.engines[None]
        self.step_stats.update(self._guard(step, "weight sync", engines.prepare, step))
        last = min(step + self.graph.units[0].settings.max_staleness, self.num_steps - 1)
        return self._submit_steps(step + 1, last)

    def _advance_partials(self, step: int) -> None:
        """Partial rollouts (`rollout.partial_tokens` T): sync this step's weights into the engines
        (after the segments queued on them, which finish under the weights they started with),
        queue one more segment of every rollout in flight (its unfinished samples resume from
        their tokens so far, by the new weights, for at most T tokens), and start the rollouts of
        the steps up to `step + max_staleness` not yet in flight, with their first segment. The
        rollout of step `step + 1`, collected before the next sync, is sampled to its end now (by
        these weights, as its collection would, while this step trains). Step m's rollout starts
        at step m - k."""
        engines, settings = self.engines[None], self.graph.units[0].settings
        self.step_stats.update(self._guard(step, "weight sync", engines.prepare, step))
        for ahead in self.ahead:
            ahead.flight.extend(None if ahead.step == step + 1 else settings.partial_tokens)
        first = self.ahead[-1].step + 1 if self.ahead else step + 1
        prompts = int(self.cfg.prompts_per_rollout)
        for m in range(first, min(step + settings.max_staleness, self.num_steps - 1) + 1):
            state = self.data_source.state_dict()
            req = self.modalities[None].request(self.data_source.next_batch(prompts), m)
            flight = self._guard(step, "rollout", engines.submit_partial, req, f"step_{m}")
            if m == step + 1:  # max_staleness 1: collected before the next sync
                flight.extend(None)
            self.ahead.append(AheadRollout(m, flight, state))

    def _submit_steps(self, first: int, last: int) -> list[AheadRollout]:
        """Submit the rollouts of steps `first`..`last` to the engines as they are (no sync), each
        with the data source's position before its prompts (for a checkpoint)."""
        engines, ahead = self.engines[None], []
        prompts = int(self.cfg.prompts_per_rollout)
        for step in range(first, last + 1):
            state = self.data_source.state_dict()
            req = self.modalities[None].request(self.data_source.next_batch(prompts), step)
            flight = self._guard(step - 1, "rollout", engines.submit, req, f"step_{step}")
            ahead.append(AheadRollout(step, flight, state))
        return ahead
