"""Every diffusion algorithm on Wan 2.1 video through the shared stage: each named recipe (default:
one per algorithm) with its model swapped for a tiny pixel-space Wan 2.1 sampling 5-frame videos,
Wan's sampling (classifier-free guidance with the empty prompt, the Euler grid shifted by 3.0)
and every image reward component wrapped in `FrameMean` (its score averaged over the frames), 2
steps in this process; prints OK / FAIL per recipe. The reward-backprop recipes score 32 px
frames (their learned reward), the rest 16 px.

    python scripts/wan_algorithms.py [recipe ...]    # names under examples/diffusion/
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from tests.conftest import EXAMPLES
from unirl.config.validate import validate_rl_config
from unirl.models.wan import LORA_TARGETS
from unirl.trainer.trainer import Trainer

RECIPES = [
    "tiny_sd3_flowgrpo", "tiny_sd3_ddpo", "tiny_sd3_dpok", "tiny_sd3_flowdppo", "tiny_sd3_diffusiondpo",
    "shapes_nft", "shapes_dancegrpo", "shapes_mixgrpo", "shapes_draft", "shapes_refl", "shapes_alignprop",
]  # fmt: skip
LEARNED_REWARD = {"shapes_draft", "shapes_refl", "shapes_alignprop"}  # SceneNet scores 32 px


def per_frame(node) -> None:
    """Wrap every component of a reward node in FrameMean (in place)."""
    components = node.backend.components
    for name in list(components):
        components[name] = {"_target_": "unirl.reward.local.video.FrameMean", "scorer": components[name]}


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
            "_target_": "unirl.models.wan.WanModelConfig",
            "pretrained_path": None,
            "num_frames": 5,
            "tiny": {"resolution": size, "num_layers": 1},
        }
        cfg.stage._target_ = "unirl.models.wan.WanStage"
        cfg.sampling.shift = 3.0
        cfg.sampling.dynamic_shift = False
        cfg.sampling.sigma_grid = "scheduler"
        if cfg.train.get("lora") is not None:
            cfg.train.lora.target_modules = list(LORA_TARGETS)
        cfg.train.fsdp.block_classes = ["WanTransformerBlock"]
        cfg.pop("eval", None)
        reward = OmegaConf.to_container(cfg.reward, resolve=True)
        cfg.reward = reward
        per_frame(cfg.reward)
        if "reward" in cfg.algorithm:  # the reward-backprop algorithms differentiate the same reward
            cfg.algorithm.reward = OmegaConf.to_container(cfg.reward)
    validate_rl_config(cfg, expect="diffusion")
    Trainer(cfg).run()
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def main(names: list[str]) -> int:
    failed = 0
    for name in names or RECIPES:
        start = time.time()
        try:
            rows = run(name, tempfile.mkdtemp(prefix=f"wan_{name}_"))
            print(
                f"OK   {name}: {len(rows)} steps, loss {[round(r['loss'], 5) for r in rows]}, {time.time() - start:.0f} s"
            )
        except Exception as e:  # report every recipe, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
