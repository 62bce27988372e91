"""Every diffusion algorithm on Qwen-Image through the shared stage: each named recipe (default: one
per algorithm) with its model swapped for a tiny pixel-space Qwen-Image and Qwen-Image's sampling
(true CFG 4.0 against the negative prompt " ", norm rescaled; `sigma_grid: steps`, dynamic shift on
Qwen-Image's (256, 0.5) - (8192, 0.9) line), 2 steps in this process; prints OK / FAIL per recipe.
The reward-backprop recipes score 32 px images (their learned reward), the rest 16 px.

    python scripts/qwenimage_algorithms.py [recipe ...]    # names under examples/diffusion/
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from tests.conftest import EXAMPLES
from unirl.config.validate import validate_rl_config
from unirl.models.qwenimage import LORA_TARGETS
from unirl.trainer.trainer import Trainer

RECIPES = [
    "tiny_sd3_flowgrpo", "tiny_sd3_ddpo", "tiny_sd3_dpok", "tiny_sd3_flowdppo", "tiny_sd3_diffusiondpo",
    "shapes_nft", "shapes_dancegrpo", "shapes_mixgrpo", "shapes_draft", "shapes_refl", "shapes_alignprop",
]  # fmt: skip
LEARNED_REWARD = {"shapes_draft", "shapes_refl", "shapes_alignprop"}  # SceneNet scores 32 px


def run(name: str, out: str) -> list[dict]:
    size = 32 if name in LEARNED_REWARD else 16
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            f"diffusion/{name}",
            overrides=[
                "++launcher=in_process", "transport=inband", "num_devices=1", "num_steps=2", "threads_per_worker=1",
                f"output_dir={out}", "logging.progress=false", "logging.save_images_every=0", "prompts_per_rollout=2",
                "sampling.samples_per_prompt=4", f"sampling.height={size}", f"sampling.width={size}",
                "sampling.max_sequence_length=8", "train.stack.micro_batch_size=4",
            ],
        )  # fmt: skip
    with open_dict(cfg):
        cfg.model = {
            "_target_": "unirl.models.qwenimage.QwenImageModelConfig",
            "pretrained_path": None,
            "negative_prompt": " ",
            "tiny": {"resolution": size, "num_layers": 1},
        }
        cfg.stage._target_ = "unirl.models.qwenimage.QwenImageStage"
        cfg.sampling.guidance_scale = 4.0
        cfg.sampling.dynamic_shift = True
        cfg.sampling.max_seq_len = 8192
        cfg.sampling.max_shift = 0.9
        cfg.sampling.sigma_grid = "steps"
        if cfg.train.get("lora") is not None:
            cfg.train.lora.target_modules = list(LORA_TARGETS)
        cfg.train.fsdp.block_classes = ["QwenImageTransformerBlock"]
        cfg.pop("eval", None)
    validate_rl_config(cfg, expect="diffusion")
    Trainer(cfg).run()
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def main(names: list[str]) -> int:
    failed = 0
    for name in names or RECIPES:
        start = time.time()
        try:
            rows = run(name, tempfile.mkdtemp(prefix=f"qwenimage_{name}_"))
            print(
                f"OK   {name}: {len(rows)} steps, loss {[round(r['loss'], 5) for r in rows]}, {time.time() - start:.0f} s",
                flush=True,
            )
        except Exception as e:  # report every recipe, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
