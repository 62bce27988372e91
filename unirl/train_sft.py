"""Entry point: `python -m unirl.train_sft --config-name=sft/<recipe> [key=value ...]`.

Supervised training in this process, chosen by the type of the `sft` node: flow matching
of a text-to-image bundle (`FlowMatchingSFTConfig`), completion cross-entropy of a causal
LM on (prompt, completion) pairs (`CausalLMSFTConfig`), or offline Diffusion-DPO on
preference pairs from a file (`OfflineDiffusionDPOConfig`); pretraining or the SFT stage
before RL. Resumes from `output_dir` when a `sft_state.pt` is there; exports the model (fp16) to
`export_dir` when `sft.num_steps` is reached. `max_seconds` bounds one invocation's wall
clock (the next one resumes).
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig

from unirl.config.validate import ConfigError, validate_sft_config
from unirl.distributed.cores import apply_thread_count, govern_threads


def trainer_class(sft_cfg: object, model_cfg: object) -> type:
    """The trainer of a built `sft` config (FlowMatchingSFT, CausalLMSFT or OfflineDiffusionDPO), after checking
    that `model` builds the modality it trains."""
    from unirl.train.lm_sft import CausalLMSFT, CausalLMSFTConfig
    from unirl.train.preference import OfflineDiffusionDPO, OfflineDiffusionDPOConfig
    from unirl.train.sft import FlowMatchingSFT, FlowMatchingSFTConfig

    trainers = {
        FlowMatchingSFTConfig: (FlowMatchingSFT, "diffusion"),
        CausalLMSFTConfig: (CausalLMSFT, "text"),
        OfflineDiffusionDPOConfig: (OfflineDiffusionDPO, "diffusion"),
    }
    if type(sft_cfg) not in trainers:
        raise TypeError(
            f"sft._target_ builds {type(sft_cfg).__name__}; unirl.train_sft runs "
            f"{' or '.join(c.__module__ + '.' + c.__name__ for c in trainers)}"
        )
    trainer, modality = trainers[type(sft_cfg)]
    if getattr(model_cfg, "modality", None) != modality:
        raise TypeError(
            f"sft: {type(sft_cfg).__name__} trains {modality} models but model._target_ builds "
            f"{type(model_cfg).__name__} ({getattr(model_cfg, 'modality', None)}); pair them"
        )
    return trainer


@hydra.main(config_path="../examples", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    run_sft(cfg)


def run_sft(cfg: DictConfig) -> None:
    """Validate a supervised recipe (exit 2 listing every problem), then train it in this process."""
    try:
        validate_sft_config(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from unirl.distributed.device import resolve_device
    from unirl.trainer.worker import build, quiet_library_logs

    quiet_library_logs()
    govern_threads(cfg.get("threads"))
    torch.manual_seed(cfg.sft.seed)
    sft_cfg, model_cfg = build(cfg.sft), build(cfg.model)
    trainer_cls = trainer_class(sft_cfg, model_cfg)
    bundle = model_cfg.build().to(resolve_device())  # a GPU when there is one, else the CPU
    trainer = trainer_cls(bundle, build(cfg.data), sft_cfg, str(cfg.output_dir), build(cfg.get("eval")))
    trainer.before_step = apply_thread_count  # the governor's count changes only between steps
    trainer.run(max_seconds=cfg.get("max_seconds"), recipe=cfg)
    if trainer.step >= trainer.cfg.num_steps and cfg.get("export_dir"):
        trainer.export(str(cfg.export_dir))


if __name__ == "__main__":
    main()
