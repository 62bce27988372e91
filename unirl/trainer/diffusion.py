"""`DiffusionTrainer`: the driver of a diffusion RL run (single controller on Ray).

Per step: prompts -> rollout (workers) -> reward (driver) -> advantages
(driver) -> train (workers). The driver holds ids, media for scoring, rewards
and advantages; the trainer owns placement, worker construction and phase order.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from unirl.distributed.group import DevicePool, placement, remote
from unirl.sde.schedules import sigmas_for
from unirl.tracking.metrics import JsonlWriter, save_image_grid
from unirl.train.stack import reduce_metrics
from unirl.trainer.diffusion_worker import DiffusionWorker, build
from unirl.types.rollout_req import RolloutReq


class DiffusionTrainer:
    """Runs `cfg.num_steps` steps of the recipe `cfg` (already validated).

    Writes into `cfg.output_dir`: `config.yaml` (resolved), `metrics.jsonl`
    (one row per step), `samples/step_XXXX.png` (+ .json prompts and
    rewards) every `logging.save_images_every` steps and at the last step,
    `base_model/` for a tiny model, and `checkpoints/final/` (weights that
    `unirl.models.sd3.load_checkpoint` loads back).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = str(cfg.output_dir)
        self.sampling = build(cfg.sampling)
        self.data_source = build(cfg.data_source)
        self.reward = build(cfg.reward)
        self.advantage = build(cfg.advantage)
        self.num_steps = int(cfg.num_steps)

    def run(self) -> list[dict[str, Any]]:
        """Run the loop; returns the metric rows it wrote."""
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(self.cfg, resolve=True))
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(
                num_cpus=max(2 * int(self.cfg.num_devices), os.cpu_count() or 1),
                include_dashboard=False,
                log_to_driver=True,
                _node_ip_address="127.0.0.1",
            )
        pool = DevicePool(int(self.cfg.num_devices))
        group = None
        try:
            plain = OmegaConf.to_container(self.cfg, resolve=True)
            plain.pop("hydra", None)
            tiny = not self.cfg.model.get("pretrained_path")
            base_model = (
                os.path.abspath(os.path.join(self.out, "base_model"))
                if tiny
                else self.cfg.model.pretrained_path
            )
            stack_cfg = self.cfg.train.stack
            group = remote(
                DiffusionWorker,
                placement(pool),
                plain,
                self.num_steps * int(stack_cfg.num_updates_per_batch),
                base_model if tiny else None,
            )
            rows = self._loop(group)
            group.save_weights(os.path.join(self.out, "checkpoints", "final"), base_model)
            return rows
        finally:
            if group is not None:
                group.shutdown()
            pool.shutdown()
            if started_ray:
                ray.shutdown()

    def _loop(self, group) -> list[dict[str, Any]]:
        info = group.model_info()
        sp = self.sampling
        cell = info["vae_scale_factor"] * info["patch_size"]
        sigmas = sigmas_for(sp, (sp.height // cell) * (sp.width // cell))
        log_cfg = self.cfg.get("logging") or {}
        every = int(log_cfg.get("save_images_every", 10))
        writer = JsonlWriter(os.path.join(self.out, "metrics.jsonl"))
        rows = []
        bar = tqdm(range(self.num_steps), desc="train", disable=not log_cfg.get("progress", True))
        try:
            for step in bar:
                t0 = time.perf_counter()
                examples = self.data_source.next_batch(int(self.cfg.prompts_per_rollout))
                req = RolloutReq.from_prompts(examples, sp, sigmas, rollout_id=step)
                track = group.rollout(req)
                t1 = time.perf_counter()
                row: dict[str, Any] = {"step": step + 1}
                row.update(self.reward.score_and_attach(track))
                track.compute_advantages(self.advantage)
                t2 = time.perf_counter()
                row.update(reduce_metrics(group.train(track, step / self.num_steps)))
                t3 = time.perf_counter()
                row.update(
                    {
                        "time/rollout_s": t1 - t0,
                        "time/reward_s": t2 - t1,
                        "time/train_s": t3 - t2,
                        "time/step_s": t3 - t0,
                    }
                )
                writer.write(row)
                rows.append(row)
                bar.set_postfix(reward=f"{row['reward/mean']:.4f}", loss=f"{row['loss']:.2e}")
                if every > 0 and ((step + 1) % every == 0 or step + 1 == self.num_steps):
                    save_image_grid(
                        track.media,
                        os.path.join(self.out, "samples", f"step_{step + 1:04d}.png"),
                        track.prompts,
                        track.rewards.tolist(),
                    )
        finally:
            writer.close()
        return rows
