"""`Trainer`: the driver of an RL run, diffusion or text (single controller on Ray).

One loop for every modality: what differs per modality (building a rollout
request, the fields scoring fetches, how samples are kept) is a
`unirl.trainer.modality` object chosen by the recipe's sampling params; the
model family, stage and algorithm live in the workers. Per step: prompts -> rollout (workers put their tracks into the transport,
the driver gets metas) -> reward (driver fetches only what scoring needs) ->
advantages (driver) -> train (each worker fetches its shard by meta) ->
[checkpoint]; the step's partition is cleared in a ``finally``. The driver
holds metas, ids, media for scoring, rewards and advantages; the trainer owns
placement, worker construction, the transport, phase order, checkpoints and
resume.
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
from unirl.dataplane import BatchMeta, make_transport
from unirl.distributed.cores import apply_thread_count, governed_threads, usable_cores
from unirl.distributed.group import DevicePool, WorkerError, in_process, placement, remote
from unirl.distributed.group.cluster import init_ray
from unirl.reward.service import RewardError
from unirl.tracking.gallery import write_gallery
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
from unirl.trainer.engines import DedicatedRollouts, InFlightRollout, RolloutSettings, TrainsideRollouts
from unirl.trainer.modality import modality_for
from unirl.trainer.step_record import StepRecord
from unirl.trainer.worker import RLWorker, build
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


class Trainer:
    """Runs the recipe `cfg` (already validated) up to `cfg.num_steps`.

    Writes into `cfg.output_dir`: `config.yaml` (resolved), `metrics.jsonl`
    (one row per step; with `eval`, a step-0 row and `eval/...` keys every
    `eval.every_n_steps` steps and at the end), `samples/step_XXXX.png` (+ .json prompts and
    rewards; a text run writes only the .json, with the responses) every `logging.save_images_every` steps and at the last step,
    `gallery.html` (self-contained: sample grids, prompts, reward and accuracy curves),
    what the trackers the recipe's `tracking` lists write (rows, samples and the resolved
    recipe; `unirl/tracking/README.md`),
    `base_model/` for a tiny model, `checkpoints/step_XXXXXX/` every
    `checkpoint.every_n_steps` steps, and `checkpoints/final/` (weights that the model
    config's `load_checkpoint` loads back; with `train.ema`, the EMA weights in the same
    format in `checkpoints/final_ema/`). With `resume_from` (a
    checkpoint directory or `latest`) it continues from that step and the run
    is identical to one that never stopped.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = str(cfg.output_dir)
        self.sampling = build(cfg.sampling)
        self.data_source = build(cfg.data_source)
        self.reward = build(cfg.reward)
        self.advantage = build(cfg.advantage)
        self.algorithm = build(cfg.algorithm)  # the driver asks it only for its dynamic-sampling hook
        self.num_steps = int(cfg.num_steps)
        self.rollout_settings = RolloutSettings.of(cfg)
        self.rollouts: TrainsideRollouts | DedicatedRollouts | None = None
        self.keep_graph = bool(cfg.rollout.get("keep_graph", False))
        ckpt = cfg.get("checkpoint") or {}
        self.every_n = int(ckpt.get("every_n_steps", 0) or 0)
        self.tiny = not cfg.model.get("pretrained_path")
        self.base_model = (
            os.path.abspath(os.path.join(self.out, "base_model"))
            if self.tiny
            else os.path.abspath(str(cfg.model.pretrained_path))
        )
        self.last_checkpoint: str | None = None
        self.step_stats: dict[str, float] = {}  # weight-sync figures of the step, for its row
        self.ahead_step: int | None = None
        self.ahead_source_state: dict[str, Any] | None = None
        self.restore_s: float | None = None
        self.transport = make_transport(cfg.transport)
        ev = cfg.get("eval")
        self.eval_every = int(ev.get("every_n_steps", 0) or 0) if ev else 0
        if ev:
            examples = build(ev.examples)
            self.eval_examples = list(getattr(examples, "examples", examples))
            self.eval_scorer = build(ev.scorer)
            self.eval_sampling = build(ev.sampling)
            self.eval_use_ema = bool(ev.get("use_ema", False))

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
            self._export(group)
            return rows

    @contextlib.contextmanager
    def _workers(self) -> Iterator[Any]:
        """The run's processes, up for the `with` block and torn down after it whatever happens:
        Ray (started here unless already running or joined), the device pool, the transport, the
        worker group (in this process with `launcher: in_process`) and the rollout engines
        (`self.rollouts`); writes `placement.json`. Yields the worker group."""
        local = self.cfg.get("launcher", "ray") == "in_process"
        devices = self._pool_devices()
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

    worker_class: type = RLWorker
    engine_class: type = EngineWorker  # a dedicated engine's actor

    def _pool_devices(self) -> int:
        """Devices the run reserves: the training devices, plus the engines' own when separate."""
        return self.rollout_settings.pool_devices(int(self.cfg.num_devices))

    def _start_engines(
        self, plain: dict[str, Any], pool: Any, group: Any, transport_info: dict[str, Any]
    ) -> list:
        """Set `self.rollouts` (the train workers', or dedicated engines fed by weight sync);
        returns the engines' `process_info` for placement.json."""
        if self.rollout_settings.dedicated:
            self.rollouts = self._guard(
                0,
                "engine setup",
                DedicatedRollouts,
                self.rollout_settings,
                plain,
                pool,
                group,
                transport_info,
                WORKER_ENV,
                self.engine_class,
            )
        else:
            self.rollouts = TrainsideRollouts(group)
        return self._guard(0, "process_info", self.rollouts.process_info)

    def _stop_engines(self) -> None:
        """Shut down what `_start_engines` started (whatever state the run is in)."""
        if self.rollouts is not None:
            self.rollouts.shutdown()

    def _worker_args(self, plain: dict[str, Any], transport_info: dict[str, Any]) -> tuple:
        """Arguments of every worker after its `RankInfo` (the resolved recipe first)."""
        updates = self.num_steps * build(self.cfg.train.stack).steps_per_rollout
        save_base = self.tiny and saves_base_model(self.cfg)
        return (plain, updates, self.base_model if save_base else None, transport_info)

    def _export(self, group) -> None:
        """Write `checkpoints/final/` (and `final_ema/` with `train.ema`) after the last step."""
        final = os.path.join(self.out, "checkpoints", "final")
        self._call(group, "save_weights", self.num_steps - 1, final, self.base_model)
        if self.cfg.train.get("ema"):
            self._call(group, "save_weights", self.num_steps - 1, final + "_ema", self.base_model, True)

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
            who = f"rollout engine {exc.rank} failed: " if exc.worker_cls == "EngineWorker" else ""
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

    def _restore(self, group, path: str) -> int:
        state = read_driver_state(path)
        self._call(group, "load_checkpoint", state["step"], path)
        self.data_source.load_state_dict(state["data_source"])
        behind = state.get("engine_weights_version")
        if behind is not None and self.rollout_settings.max_staleness:
            # the checkpoint was taken with the next rollout in flight: the engines get the weights it
            # sampled, and the resumed run samples that rollout again from them
            self._guard(state["step"], "restore engine weights", self.rollouts.load_weights, path, behind)
        self.last_checkpoint = path
        metrics = os.path.join(self.out, "metrics.jsonl")
        if os.path.exists(metrics):  # drop rows a stopped run wrote after its last checkpoint
            with open(metrics) as f:
                kept = [line for line in f if json.loads(line)["step"] <= state["step"]]
            with open(metrics, "w") as f:
                f.writelines(kept)
        return int(state["step"])

    def _save_checkpoint(self, group, step: int, ahead: InFlightRollout | None = None) -> None:
        """Write the workers' state and the driver's. With the next step's rollout in flight
        (`ahead`, max_staleness 1) the checkpoint also holds the weights that rollout samples
        (the engines', one version behind the trainer's) and the data source's position
        before its prompts, so a resumed run samples it again identically."""
        path = checkpoint_dir(self.out, step)
        t0 = time.perf_counter()
        self._call(group, "save_checkpoint", step - 1, path, self.base_model)
        source, extra = self.data_source.state_dict(), {}
        if ahead is not None:
            self._guard(step - 1, "save engine weights", self.rollouts.save_weights, path)
            source, extra = self.ahead_source_state, {"engine_weights_version": ahead.version}
        write_driver_state(path, step, source, self.cfg, save_s=time.perf_counter() - t0, extra=extra)
        mark_complete(path)
        self.last_checkpoint = path

    def _evaluate(self, group, step: int, modality) -> dict[str, float]:
        """`eval/...` accuracies on the held-out prompts, sampled deterministically on the workers
        (from the EMA weights with `eval.use_ema`) and scored as the modality says."""
        world = int(self.cfg.num_devices) // sequence_parallel_degree(self.cfg)  # sample shards

        def sample(req):
            n = len(req)
            if n % world:  # pad with copies of the last sample so every rank gets the same count
                req = req.select(list(range(n)) + [n - 1] * (world - n % world))
            out = self._call(group, "sample_eval", step, req, self.eval_use_ema)
            if isinstance(out, list):  # texts: one list per rank
                out = [t for part in out for t in part]
            return out[:n]

        metrics = modality.evaluate(sample, self.eval_examples, self.eval_scorer, self.eval_sampling)
        return {f"eval/{k}": v for k, v in metrics.items()}

    def _rollout_and_score(
        self, group, modality, step: int, partition: str, row: dict[str, Any], ahead: InFlightRollout | None
    ):
        """Draw prompts, roll out, fetch what scoring needs and score; returns the train batch's
        (meta, scored track, time the first rollout ended) and adds the reward metrics to `row`.

        The rollout runs where the recipe says (`self.rollouts`: the train workers, or dedicated
        engines synced to this step's weights first); each finished chunk is scored while the
        rest generates. `ahead`: this step's rollout, submitted during the previous step
        (`rollout.max_staleness: 1`); its engines then keep their weights for any extra
        generation, and `rollout/staleness` says how many versions behind they sampled.

        With an algorithm that samples dynamically (`dynamic_sampling_limit()` not None: DAPO),
        the groups its `keep_groups` drops (DAPO: those whose rewards are all equal) are dropped and more prompts are rolled out into the same
        partition until `prompts_per_rollout` groups with signal are kept (the first ones, in
        order), at most `max_num_gen_batches` generations. The row's reward metrics are the
        first generation's (the policy's reward as sampled); `dynamic/...` counts the rest.
        """
        prompts = int(self.cfg.prompts_per_rollout)
        limit = self.algorithm.dynamic_sampling_limit()
        dynamic = limit is not None
        metas, tracks, kept, t_first = [], [], [], None
        max_batches = limit if dynamic else 1
        stale = self.rollout_settings.max_staleness > 0 and self.rollouts.version is not None

        def score(chunk: RolloutTrack) -> None:
            if self.reward is None:  # a supervised track: its demonstrations carry no reward
                chunk.rewards = torch.zeros(len(chunk))
                return
            self._driver_phase(step, "reward", self.reward.score_and_attach, chunk)

        for k in range(max_batches):
            if k == 0 and ahead is not None:
                flight = ahead
            else:
                # extra generations get rollout ids past every step's own, so their seeds and ids are new
                req = modality.request(self.data_source.next_batch(prompts), step + k * self.num_steps)
                if not stale:
                    self.step_stats.update(self._guard(step, "weight sync", self.rollouts.prepare, step))
                flight = self._guard(step, "rollout", self.rollouts.submit, req, partition)
            fields = modality.reward_fields
            if self.advantage is not None and self.advantage.estimator == "gae" and "segment" not in fields:
                fields = [*fields, "segment.values"]  # GAE's per-step values
            meta, track, t_done = self._guard(step, "rollout", flight.collect, self.transport, fields, score)
            t_first = t_first or t_done
            if k == 0:
                if self.reward is not None:
                    row.update(self.reward.metrics(track))
                if self.rollout_settings.dedicated:
                    row["rollout/staleness"] = step - flight.version
            offset = sum(len(m) for m in metas)
            metas.append(meta)
            tracks.append(track)
            if not dynamic:
                return meta, track, t_first
            kept += [offset + i for i in self.algorithm.keep_groups(track.rewards, track.group_ids)]
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

    def _loop(self, group, start: int) -> list[dict[str, Any]]:
        modality = modality_for(self.sampling, self._call(group, "model_info", start))
        log_cfg = self.cfg.get("logging") or {}
        every = int(log_cfg.get("save_images_every", 10))
        tracking = Tracking.from_recipe(self.out, self.cfg)
        rows = []
        if self.eval_every and start == 0:
            row0 = {"step": 0, **self._evaluate(group, 0, modality)}
            tracking.log(row0)
            rows.append(row0)
        bar = tqdm(
            range(start, self.num_steps),
            initial=start,
            total=self.num_steps,
            desc="train",
            disable=not log_cfg.get("progress", True),
        )
        ahead = None  # the next step's rollout, running while this step trains (max_staleness 1)
        try:
            for step in bar:
                apply_thread_count()  # a step starts: the governor's count for all of it (cores.py)
                record = StepRecord(step)
                row = record.row
                partition = f"step_{step}"
                trained = False
                try:
                    meta, track, t_rollout = self._rollout_and_score(
                        group, modality, step, partition, row, ahead
                    )
                    record.mark("rollout", t_rollout)
                    ahead = None
                    if self.advantage is None:  # a supervised track: nothing to weigh its samples by
                        track.advantages = torch.zeros(len(track))
                    else:
                        self._driver_phase(step, "advantages", track_advantages, track, self.advantage)
                    record.mark("reward")
                    self._guard(step, "sleep", self.rollouts.release)  # colocated engines free the devices
                    if self.rollout_settings.max_staleness and step + 1 < self.num_steps:
                        ahead = self._submit_ahead(modality, step)
                    record.mark("train")
                    shard_meta = self.transport.claim(meta, "train")
                    progress = step / self.num_steps
                    metrics = self._call(
                        group, "train", step, shard_meta, track.rewards, track.advantages, progress
                    )
                    trained = True
                    row.update(reduce_metrics(metrics))
                    record.mark("trained")
                finally:  # a failed step leaks nothing: its partition goes either way
                    self.transport.clear(partition)
                    meta = shard_meta = None
                    if self.keep_graph and not trained:  # graphs kept by rollout for a train that never ran
                        self._release_kept(group, partition)
                engine_stats = self._guard(step, "dataplane_stats", self.rollouts.stats)
                dataplane = (
                    self._call(group, "dataplane_stats", step) + engine_stats + [self.transport.stats.drain()]
                )
                record.add_resources(dataplane, self._call(group, "peak_memory_mb", step))
                row.update(self.step_stats)
                self.step_stats = {}
                if "ratio/first_update_mean" in row and self.rollout_settings.dedicated:
                    row["off_policy/ratio_mean"] = row["ratio/first_update_mean"]
                if self.rollout_settings.dedicated:
                    engines = self._guard(step, "memory_mb", self.rollouts.memory_mb)
                    row["memory/engine_rss_mb"] = max(e["rss"] for e in engines)  # after sleep when colocated
                    # sleep, and the weight sync of an ahead rollout
                    row["time/engine_release_s"] = record.marks["train"] - record.marks["reward"]
                record.add_timings()
                if self.eval_every and ((step + 1) % self.eval_every == 0 or step + 1 == self.num_steps):
                    row.update(self._evaluate(group, step, modality))
                if self.restore_s is not None and step == start:
                    row["time/restore_s"] = self.restore_s
                tracking.log(row)
                rows.append(row)
                if self.every_n and (step + 1) % self.every_n == 0:
                    self._save_checkpoint(group, step + 1, ahead)
                loss = row.get("loss", float("nan"))  # none while a critic warms up alone
                bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.4f}", loss=f"{loss:.2e}")
                if every > 0 and ((step + 1) % every == 0 or step + 1 == self.num_steps):
                    stem = os.path.join(self.out, "samples", f"step_{step + 1:04d}")
                    modality.save_samples(track, stem)
                    write_gallery(self.out)
                    tracking.log_samples(step + 1, stem)
        finally:
            tracking.close()
            if ahead is not None:  # a failed step leaves the next step's rollout: drop what it put
                self.transport.clear(f"step_{self.ahead_step}")
        return rows

    def _submit_ahead(self, modality, step: int) -> InFlightRollout:
        """Sync this step's weights into the engines and start the next step's rollout on them,
        to run while this step trains (its samples are one weight version behind when trained).
        Keeps the data source's position before the next batch's prompts for a checkpoint."""
        self.step_stats.update(self._guard(step, "weight sync", self.rollouts.prepare, step))
        self.ahead_step = step + 1
        self.ahead_source_state = self.data_source.state_dict()
        prompts = int(self.cfg.prompts_per_rollout)
        req = modality.request(self.data_source.next_batch(prompts), step + 1)
        return self._guard(step, "rollout", self.rollouts.submit, req, f"step_{step + 1}")
