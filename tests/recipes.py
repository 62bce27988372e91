"""Shrunk recipes run in this process: compose `examples/<name>.yaml` at a test's size, validate it,
run its trainer, read back its rows and exported weights.

The shrunk sets keep every component of a recipe and only make it small: the tiny Flow-GRPO
recipes at 16x16 with 2 prompts x 4 samples and 4 denoising steps (2 of them SDE), the tiny LM
recipes with 4 prompts x 4 samples and 8 new tokens; any other recipe runs at its own size, only
quiet. `composed` puts the set before the caller's overrides, so a caller's override wins.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from safetensors.torch import load_file

from tests.conftest import EXAMPLES

QUIET = ["logging.progress=false", "logging.save_images_every=0"]
SIXTEEN_PX = [  # a flow recipe at a test's size: 8 samples of 16 px, 4 denoising steps, 2 of them SDE
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=4",
    "sampling.num_steps=4",
    "sampling.sde_num_steps=2",
    "sampling.height=16",
    "sampling.width=16",
    "sampling.max_sequence_length=8",
    "model.tiny.resolution=16",
    "model.tiny.clip_max_length=8",
    *QUIET,
]
SD3 = [*SIXTEEN_PX, "model.tiny.num_layers=2", "train.stack.micro_batch_size=2"]
FLUX = [*SIXTEEN_PX, "train.stack.micro_batch_size=4"]  # tiny_flux_flowgrpo
LM = [
    "prompts_per_rollout=4",
    "sampling.samples_per_prompt=4",
    "sampling.max_new_tokens=8",
    "train.stack.micro_batch_size=4",
    "threads_per_worker=1",
    *QUIET,
]
SMALL = {  # the shrunk set of each recipe that has one
    "diffusion/tiny_sd3_flowgrpo": SD3,
    "diffusion/tiny_sd3_dedicated_colocate": SD3,
    "diffusion/tiny_sd3_dedicated_separate": SD3,
    "diffusion/tiny_ppo": SD3,
    "diffusion/tiny_flux_flowgrpo": FLUX,
    "llm/tiny_lm_grpo": LM,
    "llm/tiny_lm_dapo": LM,
    "llm/tiny_lm_dedicated": LM,
    "llm/tiny_lm_grpo_vllm": LM,
    "llm/tiny_lm_ppo": LM,
}
# one process, no Ray: the driver trains its only worker itself and moves data in band
IN_PROCESS = ["++launcher=in_process", "transport=inband", "num_devices=1"]


class MeanPixel:
    """An evaluation scorer that any change of the images moves: their mean pixel value (0-255).
    (The shapes scorer's accuracies barely move on a random model in a few steps.)"""

    def evaluate(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        return {"mean_pixel": float(images.to(torch.float64).mean())}


def composed(name: str, out, *overrides: str) -> DictConfig:
    """`examples/<name>.yaml` with its shrunk set, `output_dir=out` and `overrides` (not validated)."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(name, overrides=[*SMALL.get(name, QUIET), f"output_dir={out}", *overrides])


def recipe(name: str, out, *overrides: str, expect: str | None = None) -> DictConfig:
    """`composed(name, out, *overrides)`, validated by the one validator (a single-track recipe as
    one of modality `expect`; None: either)."""
    from unirl.config.validate import validate_recipe

    cfg = composed(name, out, *overrides)
    validate_recipe(cfg, expect=expect)
    return cfg


def run(name: str, out, *overrides: str) -> list[dict]:
    """Train `recipe(name, out, *overrides)` to the end; the rows of `out/metrics.jsonl`."""
    from unirl.trainer.trainer import Trainer

    Trainer(recipe(name, out, *overrides)).run()
    return rows(out)


def stopped_and_resumed(name: str, out, *overrides: str, stop: int = 2, steps: int = 4) -> tuple[list, list]:
    """`steps` uninterrupted steps in `out/full`; in `out/part`, `stop` steps with a checkpoint at
    `stop`, then resumed from it to `steps`. The rows of both: (uninterrupted, resumed)."""
    full = run(name, out / "full", f"num_steps={steps}", *overrides)
    run(name, out / "part", f"num_steps={stop}", f"checkpoint.every_n_steps={stop}", *overrides)
    return full, run(name, out / "part", f"num_steps={steps}", "resume_from=latest", *overrides)


def per_transport(name: str, out, transports: list[str], *overrides: str) -> dict[str, tuple]:
    """`run(name, out / t, *overrides, f"transport={t}")` for each transport t: {t: (its output
    directory, its rows)}."""
    return {t: (out / t, run(name, out / t, *overrides, f"transport={t}")) for t in transports}


def rows(out) -> list[dict]:
    """The metrics rows a run wrote to `out/metrics.jsonl`, in order."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def exported_weights(out, name: str = "final") -> dict[str, torch.Tensor]:
    """Every tensor of the export `out/checkpoints/<name>/` (a LoRA or peft adapter file, a
    diffusers or transformers layout, one directory per track), keyed `<file>:<tensor>` with the
    file relative to the export."""
    root = os.path.join(out, "checkpoints", name)
    files = sorted(glob.glob(os.path.join(root, "**", "*.safetensors"), recursive=True))
    return {f"{os.path.relpath(f, root)}:{k}": v for f in files for k, v in load_file(f).items()}


def same_weights(a, b, name: str = "final") -> bool:
    """The exports `checkpoints/<name>/` of runs `a` and `b` hold the same tensors, bit for bit
    (and hold some)."""
    wa, wb = exported_weights(a, name), exported_weights(b, name)
    return len(wa) > 0 and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
