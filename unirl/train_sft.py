"""Entry point: `python -m unirl.train_sft --config-name=sft/<recipe> [key=value ...]`.

Supervised flow-matching training of a text-to-image bundle (pretraining or
the SFT stage before RL), in this process. Resumes from `output_dir` when a
`sft_state.pt` is there; exports the bundle to `export_dir` when `sft.num_steps`
is reached. `max_seconds` bounds one invocation's wall clock (the next one resumes).
"""

from __future__ import annotations

import os
import sys

import hydra
import torch
from omegaconf import DictConfig

from unirl.config.validate import ConfigError, validate_sft_config


@hydra.main(config_path="../examples", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        validate_sft_config(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from unirl.distributed.device import resolve_device
    from unirl.train.sft import FlowMatchingSFT
    from unirl.trainer.worker import build, quiet_library_logs

    quiet_library_logs()
    torch.set_num_threads(cfg.get("threads") or os.cpu_count() or 1)
    torch.manual_seed(cfg.sft.seed)
    bundle = build(cfg.model).build().to(resolve_device())  # a GPU when there is one, else the CPU
    trainer = FlowMatchingSFT(
        bundle, build(cfg.data), build(cfg.sft), str(cfg.output_dir), build(cfg.get("eval"))
    )
    trainer.run(max_seconds=cfg.get("max_seconds"))
    if trainer.step >= trainer.cfg.num_steps and cfg.get("export_dir"):
        trainer.export(str(cfg.export_dir))


if __name__ == "__main__":
    main()
