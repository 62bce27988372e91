"""`ComposedTrainer`: the driver of a multi-track run (a prompt enhancer feeding a diffusion model).

Per step: user prompts -> the chain, walked root first on the driver: each track
is sampled where `tracks.<name>.engine` says (the train workers' own module, or
dedicated engines fed by weight sync, a vLLM engine among them) and put into the
transport under its own partition; the next track's request is built from its
texts (`child_request`) -> rewards, leaf first: the leaf's reward scores its samples (images against the
user's intent), each parent receives the `tracks.<name>.aggregate` (mean | max |
min) of its children's rewards plus its own reward when `rewards.<name>` is set
-> advantages per trained track over that track's groups (a user prompt's
rewrites; a rewrite's images) -> each trained track trains on its own stack.
Rows prefix each track's metrics with `<track>/`; `reward/mean` is the leaf's.

Placement, checkpoints, resume and failure reporting are the single-track
`Trainer`'s (this class reuses them), and so is the worker (`RLWorker`, one track per
`tracks.<name>`); what differs is the walk, the loop and evaluation.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from unirl.algorithms.advantages import track_advantages
from unirl.dataplane import BatchMeta, get_batch, make_transport
from unirl.distributed.cores import apply_thread_count
from unirl.reward.service import RewardService
from unirl.tracking.gallery import write_gallery
from unirl.tracking.metrics import save_image_grid
from unirl.tracking.trackers import Tracking
from unirl.train.stack import reduce_metrics
from unirl.trainer.checkpoints import saves_base_model
from unirl.trainer.composed_eval import ComposedEval
from unirl.trainer.engines import DedicatedRollouts, RolloutSettings
from unirl.trainer.modality import ImageModality, TextModality, modality_for
from unirl.trainer.step_record import StepRecord
from unirl.trainer.trainer import WORKER_ENV, Trainer
from unirl.trainer.worker import RLWorker, build, track_partition
from unirl.types.lineage import child_request
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import TextSamplingParams

AGGREGATES = ("mean", "max", "min")  # how a parent track's reward derives from its children's
LINEAGE_FIELDS = ["parent_ids", "root_ids"]
# what a child's request is built from (`child_request`), besides a grandparent's root ids
PARENT_FIELDS = ["sample_ids", "group_ids", "prompts", "metadata", "texts"]
# recipe keys of a composed run that a track's engine does not read
RUN_ONLY_KEYS = ("tracks", "rollout", "rewards", "data_source", "eval")


def aggregate_children(parent: RolloutTrack, child: RolloutTrack, how: str) -> torch.Tensor:
    """[Bp] fp32: for each parent sample, the `how` ("mean" | "max" | "min") of its children's
    `rewards`.

    Raises ValueError naming the ids when a child's parent is not in `parent` (naming both),
    when a parent has no child, or when the child track has no rewards or no lineage.
    """
    if how not in AGGREGATES:
        raise ValueError(f"parent reward aggregate must be one of {AGGREGATES}, got {how!r}")
    if child.rewards is None:
        raise ValueError(f"track {child.name!r} has no rewards to propagate to track {parent.name!r}")
    if child.parent_ids is None:
        raise ValueError(f"track {child.name!r} has no parent_ids: it is not a child of {parent.name!r}")
    index = {sid: i for i, sid in enumerate(parent.sample_ids)}
    rows: list[list[int]] = [[] for _ in parent.sample_ids]
    for j, pid in enumerate(child.parent_ids):
        if pid not in index:
            raise ValueError(
                f"sample {child.sample_ids[j]!r} of track {child.name!r} names parent {pid!r}, which is not in "
                f"the batch of track {parent.name!r}"
            )
        rows[index[pid]].append(j)
    empty = [parent.sample_ids[i] for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(
            f"sample(s) {empty[:3]}{' ...' if len(empty) > 3 else ''} of track {parent.name!r} have no child "
            f"in track {child.name!r}"
        )
    rewards = child.rewards.float().cpu()
    reduce = {"mean": torch.mean, "max": torch.amax, "min": torch.amin}[how]
    return torch.stack([reduce(rewards[torch.tensor(r)]) for r in rows]).to(child.rewards.device)


def track_recipe(plain: dict[str, Any], name: str) -> dict[str, Any]:
    """The single-track recipe an engine of track `name` is built from: the run's top level
    (seed, devices, threads, transport), the track's own nodes over it (model, stage, sampling,
    train, its `weight_sync`) and its `engine` as `rollout`, producing a track named `name`."""
    track = plain["tracks"][name]
    view = {k: v for k, v in plain.items() if k not in RUN_ONLY_KEYS}
    view.update({k: v for k, v in track.items() if k != "engine"})
    view["rollout"] = {**track["engine"], "track_name": name}
    return view


class ComposedTrainer(Trainer):
    """Runs the composed recipe `cfg` (already validated by `unirl.config.composed`) up to
    `cfg.num_steps`.

    Writes what `Trainer` writes, per track: `checkpoints/step_XXXXXX/<track>/` (train
    state of each trained track), `checkpoints/final/<track>/` (a trained track's weights in
    its family's format; a frozen track's whole bundle), `base_model/<track>/` for tiny
    models, and with every sample grid `samples/lineage_step_XXXX.json` (user prompt ->
    rewrites -> image rewards).
    """

    worker_class = RLWorker

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = str(cfg.output_dir)
        self.order: list[str] = list(cfg.rollout.tracks)
        self.root, self.leaf = self.order[0], self.order[-1]
        self.samplings = {n: build(cfg.tracks[n].sampling) for n in self.order}
        self.trained = [n for n in self.order if cfg.tracks[n].get("trained", True)]
        self.advantage = {n: build(cfg.tracks[n].advantage) for n in self.trained}
        self.aggregate = {n: str(cfg.tracks[n].get("aggregate", "mean")) for n in self.order[:-1]}
        self.rewards: dict[str, RewardService] = {n: build(node) for n, node in cfg.rewards.items()}
        self.data_source = build(cfg.data_source)
        self.num_steps = int(cfg.num_steps)
        self.rollout_settings = RolloutSettings(dedicated=False)
        self.rollouts = None
        # per track: where it samples (not dedicated: the train workers); its engines once started
        self.track_settings = {n: RolloutSettings.of_node(cfg.tracks[n].get("engine")) for n in self.order}
        self.track_engines: dict[str, DedicatedRollouts] = {}
        self.prompt_key = str(cfg.rollout.get("prompt_key", "user_prompt"))
        self.sigmas: dict[str, Any] = {}
        # a track whose trainside engine keeps its sampling graphs for its train phase
        self.keep_graph = any(bool((cfg.tracks[n].get("engine") or {}).get("keep_graph")) for n in self.order)
        ckpt = cfg.get("checkpoint") or {}
        self.every_n = int(ckpt.get("every_n_steps", 0) or 0)
        self.base_model = self._base_models()
        self.last_checkpoint: str | None = None
        self.restore_s: float | None = None
        self.transport = make_transport(cfg.transport)
        ev = cfg.get("eval")
        self.eval_every = int(ev.get("every_n_steps", 0) or 0) if ev else 0
        self.evaluator = self._evaluator(ev) if ev else None

    def _base_models(self) -> Any:
        """Per track: the directory its exports load onto (its `pretrained_path`, or where a tiny
        model's untrained bundle is written, `base_model/<track>`)."""
        out = {}
        for n in self.order:
            path = self.cfg.tracks[n].model.get("pretrained_path")
            out[n] = os.path.abspath(str(path) if path else os.path.join(self.out, "base_model", n))
        return out

    def _evaluator(self, ev: DictConfig) -> ComposedEval:
        return ComposedEval.from_config(ev, self.order, self.samplings)

    def _worker_args(self, plain: dict[str, Any], transport_info: dict[str, Any]) -> tuple:
        updates = {
            n: self.num_steps * build(self.cfg.tracks[n].train.stack).steps_per_rollout for n in self.trained
        }
        save_base = saves_base_model(self.cfg)
        bases = {
            n: None if self.cfg.tracks[n].model.get("pretrained_path") or not save_base else self.base_model[n]
            for n in self.order
        }
        return (plain, updates, bases, transport_info)

    def _export(self, group) -> None:
        final = os.path.join(self.out, "checkpoints", "final")
        self._call(group, "save_weights", self.num_steps - 1, final, self.base_model)

    # ---------------------------------------------------------------- engines per track

    def _pool_devices(self) -> int:
        """The training devices, plus the devices of every track's separate engines."""
        return super()._pool_devices() + sum(
            s.num_engines for s in self.track_settings.values() if s.dedicated and s.placement == "separate"
        )

    def _start_engines(self, plain: dict[str, Any], pool: Any, group: Any, transport_info: dict[str, Any]) -> list:
        """The run's rollouts (`Trainer._start_engines`), then the dedicated engines of every track
        with `tracks.<name>.engine`, built from the track's view of the recipe (`track_recipe`) and
        fed that track's weights; separate engines take the pool's devices after the training
        ones, track after track."""
        processes = super()._start_engines(plain, pool, group, transport_info)
        first = int(self.cfg.num_devices)
        for name, settings in self.track_settings.items():
            if not settings.dedicated:
                continue
            engines = self._guard(
                0,
                f"engine setup ({name})",
                DedicatedRollouts,
                settings,
                track_recipe(plain, name),
                pool,
                group,
                transport_info,
                WORKER_ENV,
                self.engine_class,
                name,
                first,
            )
            self.track_engines[name] = engines
            first += settings.num_engines if settings.placement == "separate" else 0
            info = self._guard(0, "process_info", engines.process_info)
            processes += [{**p, "track": name} for p in info]
        return processes

    def _stop_engines(self) -> None:
        for engines in self.track_engines.values():
            engines.shutdown()
        self.track_engines = {}
        super()._stop_engines()

    # ---------------------------------------------------------------- one step

    def _fields(self, name: str) -> list[str]:
        modality = TextModality if isinstance(self.samplings[name], TextSamplingParams) else ImageModality
        return modality.reward_fields + (LINEAGE_FIELDS if name != self.root else [])

    def _score(self, step: int, metas: dict[str, BatchMeta], row: dict[str, Any]) -> dict[str, RolloutTrack]:
        """Fetch what scoring needs of every track and set its rewards, leaf first: the leaf by
        its reward, each parent by the aggregate of its children's rewards (+ its own reward)."""
        views: dict[str, RolloutTrack] = {}
        child = None
        for name in reversed(self.order):
            view = get_batch(self.transport, metas[name], self._fields(name))
            own = None
            if name in self.rewards:
                self._driver_phase(step, f"reward ({name})", self.rewards[name].score_and_attach, view)
                own = view.rewards
                row.update({f"{name}/{k}": v for k, v in RewardService.metrics(view).items()})
            if child is not None:
                how = self.aggregate[name]
                agg = self._driver_phase(step, f"reward ({name})", aggregate_children, view, child, how)
                view.reward_components = {**view.reward_components, f"children_{how}": agg}
                view.reward_weights = {**view.reward_weights, f"children_{how}": 1.0}
                view.rewards = agg if own is None else agg + own
                row[f"{name}/reward/children_{how}/mean"] = agg.mean().item()
                row[f"{name}/reward/mean"] = view.rewards.mean().item()
                row[f"{name}/reward/std"] = view.rewards.std(unbiased=False).item()
            views[name] = view
            child = view
        row["reward/mean"] = row[f"{self.leaf}/reward/mean"]
        return views

    def _rollout(self, group, step: int, req: RolloutReq, partition: str, row: dict[str, Any]) -> dict[str, BatchMeta]:
        """Walk the chain root first from the root request `req`: each track's request (after the
        root's, `child_request` of its parent's texts, fetched from the transport) is sampled where
        the track says (the train workers' own module, split over the ranks; or its dedicated
        engines: synced to this step's weights first, asleep again after) into
        `track_partition(partition, name)`. Returns the metas by track; adds each engine's
        `<track>/sync/...` and `<track>/time/sync_s` to `row`."""
        if not self.sigmas:  # a child's pinned sigma schedule for its model's latent grid (text: None)
            infos = self._call(group, "model_info", step)
            self.sigmas = {n: getattr(modality_for(self.samplings[n], infos[n]), "sigmas", None) for n in self.order}
        metas: dict[str, BatchMeta] = {}
        for depth, name in enumerate(self.order):
            if depth:
                parent = self.order[depth - 1]
                fields = PARENT_FIELDS + (["root_ids"] if depth > 1 else [])
                view = get_batch(self.transport, metas[parent], fields)
                sampling = self.samplings[name]
                req = child_request(view, view.texts, sampling, self.sigmas[name], step, self.prompt_key)
            where = track_partition(partition, name)
            engines = self.track_engines.get(name)
            if engines is None:
                metas[name] = self._call(group, "rollout", step, req, where, name)
                continue
            stats = self._guard(step, f"weight sync ({name})", engines.prepare, step)
            row.update({f"{name}/{k}": v for k, v in stats.items()})
            flight = self._guard(step, f"rollout ({name})", engines.submit, req, where)
            metas[name] = self._guard(step, f"rollout ({name})", flight.chunks[0])
            self._guard(step, f"sleep ({name})", engines.release)  # colocated engines free the devices
        return metas

    def _step(self, group, step: int, partition: str, record: StepRecord) -> dict[str, RolloutTrack]:
        """Rollout, rewards, advantages and training of one step, marked on `record`; returns the
        scored views of every track."""
        row = record.row
        examples = self.data_source.next_batch(int(self.cfg.prompts_per_rollout))
        req = RolloutReq.from_prompts(examples, self.samplings[self.root], None, rollout_id=step)
        metas = self._rollout(group, step, req, partition, row)
        record.mark("rollout")
        views = self._score(step, metas, row)
        for name in self.trained:
            self._driver_phase(
                step, f"advantages ({name})", track_advantages, views[name], self.advantage[name]
            )
        record.mark("reward")
        progress = step / self.num_steps
        for name in self.trained:
            shard = self.transport.claim(metas[name], "train")
            view = views[name]
            metrics = self._call(group, "train", step, shard, view.rewards, view.advantages, progress, name)
            row.update({f"{name}/{k}": v for k, v in reduce_metrics(metrics).items()})
        record.mark("trained")
        return views

    def _loop(self, group, start: int) -> list[dict[str, Any]]:
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
                    for name in self.order:
                        self.transport.clear(track_partition(partition, name))
                    if self.keep_graph and not trained:
                        self._release_kept(group, partition)
                dataplane = self._call(group, "dataplane_stats", step) + [self.transport.stats.drain()]
                record.add_resources(dataplane, self._call(group, "peak_memory_mb", step))
                record.add_timings()
                if self.eval_every and ((step + 1) % self.eval_every == 0 or step + 1 == self.num_steps):
                    row.update(self._evaluate(group, step))
                if self.restore_s is not None and step == start:
                    row["time/restore_s"] = self.restore_s
                tracking.log(row)
                rows.append(row)
                if self.every_n and (step + 1) % self.every_n == 0:
                    self._save_checkpoint(group, step + 1)
                bar.set_postfix(reward=f"{row['reward/mean']:.4f}")
                if every > 0 and ((step + 1) % every == 0 or step + 1 == self.num_steps):
                    stem = os.path.join(self.out, "samples", f"step_{step + 1:04d}")
                    self._save_samples(views, stem)
                    write_gallery(self.out)
                    tracking.log_samples(step + 1, stem)
        finally:
            tracking.close()
        return rows

    def _save_samples(self, views: dict[str, RolloutTrack], stem: str) -> None:
        """`<stem>.png` (+ `.json`): the leaf's images, each captioned "user prompt -> rewrite"
        with its reward (the gallery shows them); `lineage_<name>.json` beside it: per user prompt,
        its rewrites with their rewards and, per rewrite, the rewards of its images."""
        leaf, root = views[self.leaf], views[self.root]
        key = self.cfg.rollout.get("prompt_key", "user_prompt")
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

    def _evaluate(self, group, step: int, references: bool = False) -> dict[str, float]:
        """`eval/...`: the composed held-out accuracies (and, with `references`, the floor and
        the ceiling: the user prompt and the canonical prompt fed straight to the image model)."""
        world = int(self.cfg.num_devices)

        def sample(req, samplings, feed):
            n = len(req)
            if n % world:  # pad with copies of the last sample so every rank gets the same count
                req = req.select(list(range(n)) + [n - 1] * (world - n % world))
            parts = self._call(group, "sample_chain", step, req, samplings, feed)
            texts = [t for p in parts for t in p["texts"]][:n]
            per = len(parts[0]["images"]) // len(parts[0]["texts"])
            images = torch.cat([p["images"] for p in parts])[: n * per]
            return texts, images

        return {f"eval/{k}": v for k, v in self.evaluator.run(sample, references).items()}
