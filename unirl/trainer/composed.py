"""`ComposedTrainer`: the driver of a multi-track run (a prompt enhancer feeding a diffusion model).

Per step: user prompts -> composed rollout on the workers (every stage of the
chain on each rank's shard; each track put into the transport on its own) ->
rewards, leaf first: the leaf's reward scores its samples (images against the
user's intent), each parent receives the `tracks.<name>.aggregate` (mean | max |
min) of its children's rewards plus its own reward when `rewards.<name>` is set
-> advantages per trained track over that track's groups (a user prompt's
rewrites; a rewrite's images) -> each trained track trains on its own stack.
Rows prefix each track's metrics with `<track>/`; `reward/mean` is the leaf's.

Placement, checkpoints, resume and failure reporting are the single-track
`Trainer`'s (this class reuses them); what differs is the worker
(`ComposedWorker`), the loop and evaluation.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from unirl.dataplane import BatchMeta, get_batch, make_transport
from unirl.distributed.cores import apply_thread_count
from unirl.reward.service import RewardService
from unirl.tracking.gallery import write_gallery
from unirl.tracking.metrics import save_image_grid
from unirl.tracking.trackers import Tracking
from unirl.train.stack import reduce_metrics
from unirl.trainer.checkpoints import saves_base_model
from unirl.trainer.composed_eval import ComposedEval
from unirl.trainer.composed_worker import ComposedWorker, track_partition
from unirl.trainer.engines import RolloutSettings
from unirl.trainer.modality import ImageModality, TextModality
from unirl.trainer.step_record import StepRecord
from unirl.trainer.trainer import Trainer
from unirl.trainer.worker import build
from unirl.types.lineage import aggregate_children
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import TextSamplingParams

LINEAGE_FIELDS = ["parent_ids", "root_ids"]


class ComposedTrainer(Trainer):
    """Runs the composed recipe `cfg` (already validated by `unirl.config.composed`) up to
    `cfg.num_steps`.

    Writes what `Trainer` writes, per track: `checkpoints/step_XXXXXX/<track>/` (train
    state of each trained track), `checkpoints/final/<track>/` (a trained track's weights in
    its family's format; a frozen track's whole bundle), `base_model/<track>/` for tiny
    models, and with every sample grid `samples/lineage_step_XXXX.json` (user prompt ->
    rewrites -> image rewards).
    """

    worker_class = ComposedWorker

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
        self.keep_graph = False
        ckpt = cfg.get("checkpoint") or {}
        self.every_n = int(ckpt.get("every_n_steps", 0) or 0)
        self.base_model = {}
        for n in self.order:
            path = cfg.tracks[n].model.get("pretrained_path")
            self.base_model[n] = os.path.abspath(
                str(path) if path else os.path.join(self.out, "base_model", n)
            )
        self.last_checkpoint: str | None = None
        self.restore_s: float | None = None
        self.transport = make_transport(cfg.transport)
        ev = cfg.get("eval")
        self.eval_every = int(ev.get("every_n_steps", 0) or 0) if ev else 0
        self.evaluator = ComposedEval.from_config(ev, self.order, self.samplings) if ev else None

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

    def _step(self, group, step: int, partition: str, record: StepRecord) -> dict[str, RolloutTrack]:
        """Rollout, rewards, advantages and training of one step, marked on `record`; returns the
        scored views of every track."""
        row = record.row
        examples = self.data_source.next_batch(int(self.cfg.prompts_per_rollout))
        req = RolloutReq.from_prompts(examples, self.samplings[self.root], None, rollout_id=step)
        per_rank = self._call(group, "rollout", step, req, partition)
        metas = {n: BatchMeta.concat([m[n] for m in per_rank]) for n in self.order}
        record.mark("rollout")
        views = self._score(step, metas, row)
        for name in self.trained:
            self._driver_phase(
                step, f"advantages ({name})", views[name].compute_advantages, self.advantage[name]
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
                try:
                    views = self._step(group, step, partition, record)
                finally:  # a failed step leaks nothing: its partitions go either way
                    for name in self.order:
                        self.transport.clear(track_partition(partition, name))
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
            parts = self._call(group, "sample_eval", step, req, samplings, feed)
            texts = [t for p in parts for t in p["texts"]][:n]
            per = len(parts[0]["images"]) // len(parts[0]["texts"])
            images = torch.cat([p["images"] for p in parts])[: n * per]
            return texts, images

        return {f"eval/{k}": v for k, v in self.evaluator.run(sample, references).items()}
