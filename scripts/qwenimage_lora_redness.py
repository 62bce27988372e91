"""A trained tiny Qwen-Image LoRA read back the way diffusers reads it: the base model and the
checkpoint's LoRA loaded through `QwenImagePipeline.load_lora_weights`
(`unirl.models.qwenimage.load_checkpoint`), each sampled by ODE (eta 0, true CFG 4.0 against " ",
the tiny recipe's schedule) on 4 prompts x 8 seeds it was not trained on; prints the redness
(`ColorTarget([1, 0, 0])`'s formula) of each.

    python scripts/qwenimage_lora_redness.py <run output dir>/checkpoints/final
"""

from __future__ import annotations

import json
import os
import sys

import torch

from unirl.models.qwenimage import QwenImageBundle, QwenImageStage, load_checkpoint
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a photo of a cat", "a landscape", "a red car", "an abstract painting"]


def redness(bundle: QwenImageBundle) -> torch.Tensor:
    """[32] redness of ODE samples at 32 px."""
    sp = DiffusionSamplingParams(
        num_steps=10, samples_per_prompt=8, height=32, width=32, guidance_scale=4.0, eta=0.0,
        dynamic_shift=True, max_seq_len=8192, max_shift=0.9, sigma_grid="steps", max_sequence_length=32, seed=123,
    )  # fmt: skip
    stage = QwenImageStage(bundle)
    req = RolloutReq.from_prompts(
        [PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)],
        sp,
        sigmas_for(sp, bundle.image_seq_len(32, 32)),
        1000,
    )
    with torch.no_grad():
        cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
        images = stage.decode_float(stage.diffuse(req, cond).at(sp.num_steps))
    return 1.0 - (images - torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)).abs().mean(dim=(1, 2, 3))


def main(checkpoint: str) -> None:
    with open(os.path.join(checkpoint, "unirl_checkpoint.json")) as f:
        base = json.load(f)["base_model"]
    for name, bundle in (
        ("base", QwenImageBundle.from_pretrained(base)),
        ("lora", load_checkpoint(checkpoint)),
    ):
        red = redness(bundle)
        print(
            f"{name}: redness {red.mean():.3f} (min {red.min():.3f}, max {red.max():.3f}) over {len(red)} ODE samples"
        )


if __name__ == "__main__":
    main(sys.argv[1])
